# Results 12-04f. Each from the repository root, one torch thread, an empty profile cache (a cold start).
F=engine/benchmarks/results/adaptive-2026-12-04f/flow.py
R=engine/benchmarks/results/adaptive-2026-12-04f
export OMP_NUM_THREADS=1
fresh() { SPECSERVE_CACHE_DIR=$(mktemp -d) "$@"; }
# at 14695c7 (prompt chunks sent with a step's draft call for rounds; l8: never sent, as before):
fresh python $F 0 32 192 a8,l8,k4 > $R/eager-t0-c32.txt
fresh python engine/benchmarks/results/adaptive-2026-12-04e/flow_reasons.py 0 32 192 4 > $R/reasons-t0-c32-14695c7.txt
# at 2585c90 (also in plain steps within 8 of a speculative one):
fresh python $F 0 32 192 a8,l8,k4 > $R/eager2-t0-c32.txt
fresh python engine/benchmarks/results/adaptive-2026-12-04e/flow_reasons.py 0 32 192 4 > $R/reasons-t0-c32-2585c90.txt
fresh python $R/pred_vs_real.py 0 32 128 > $R/pred-vs-real-t0-c32-2585c90.txt
# at 8321f60 with its condition (a size measured the step before) removed, not committed (c8: no co-movement):
fresh python $F 0 32 192 a8,c8,k4 > $R/comove-any-t0-c32.txt
# at 8321f60:
fresh python $F 0 32 192 a8,c8,k4 > $R/comove-fresh-t0-c32.txt
# at c2e84da (the eager prefill of 2585c90 still in):
fresh python $F 0 64 256 a8,l8,nospec > $R/eager-t0-c64.txt
fresh python $F 0 64 256 a8,l8 > $R/eager-t0-c64-2.txt
# at b690b6b (rounds of different depths attend apart; p8: its steps in one padded call):
fresh python $F 0 32 192 a8,k4,nospec > $R/grouped-t0-c32.txt   # twice: grouped-t0-c32-2.txt
fresh python $F 0 64 256 a8,k4,nospec > $R/grouped-t0-c64.txt
fresh python $F 0.8 32 192 a8,k4,k5,nospec > $R/grouped-t08-c32.txt
fresh python $F 0.8 64 256 a8,k4,nospec > $R/grouped-t08-c64.txt
PAIR=random fresh python $F 0 32 128 a8,k2,nospec > $R/grouped-random-t0-c32.txt
PAIR=random fresh python $F 0.8 32 128 a8,k2,nospec > $R/grouped-random-t08-c32.txt
python $R/attention_groups.py > $R/attention-groups-b690b6b.txt
fresh python $R/mixed_depths.py 6 > $R/mixed-depths-b690b6b.txt
fresh python $F 0 32 192 a8,p8,k4 > $R/control-t0-c32.txt
fresh python $F 0.8 32 192 a8,p8,k5 > $R/control-t08-c32.txt
fresh python $F 0 64 256 a8,p8,k4 > $R/control-t0-c64.txt
PAIR=random fresh python $F 0 32 128 a8,nospec > $R/grouped-random-t0-c32-2.txt
# served, interleaved: sweep-builtin-t0/ and sweep-builtin-t0.8/command-and-log.txt have the exact commands
# at 95306cb (the first version of step_split.py, the same loop; its output):
fresh python $R/step_split.py > $R/step-split-random-t0-c32-95306cb.txt
PAIR=random fresh python $F 0 32 384 a8,nospec > $R/grouped-random-t0-c32-long.txt
PAIR=random fresh python $F 0.8 32 384 a8,nospec > $R/grouped-random-t08-c32-long.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --target runs/random-pair/target --draft runs/random-pair/draft --num-prompts 8 --max-tokens 48 --batches 1 --temperatures 0,0.8 --unseeded --repeats 2 --skip-hf --skip-floor --modes specserve_nospec,specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/random-b1.txt  # at 95306cb
# served, at 95306cb: sweep-builtin-t0.8-c32-64/ and sweep-random-t0.8/command-and-log.txt have the exact commands
