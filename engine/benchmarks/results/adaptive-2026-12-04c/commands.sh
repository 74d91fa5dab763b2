set -ex
# Session 22, from the repository root, one torch thread, nothing else running. Each line's output file is named
# after it. The kmax.py variants changed during the session: the files made by variants no longer in kmax.py say
# in README.md which code they ran (the diffs are here).
. .venv/bin/activate
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-04c
# At 289fc3c (before this session's changes):
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/reasons.py 0 32 3 4 -v > $R/reasons-t0-b32-before.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 32 3 nospec,a8,a5,a4,k4 > $R/kmax-t0-b32.txt
# (level-t0-b32.txt: a8 with level-tracking.diff applied, o8 without; pad*-t0-b32.txt: p8 priced padded verifies
# (w 0.5, 1); groups-t0-b32.txt: a8 with query-groups.diff applied, u8 with it switched off; mix-margin-t0-b32.txt:
# a8 with a 3 % mix margin, m8 without; engine-rates-weight256-t0-b32.txt: w8 capped the empirical-Bayes weight at
# 256 instead of 32.)
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 32 3 a8,e8,a4,k4 > $R/engine-rates-t0-b32.txt
python $R/attention.py > $R/attention.txt
# After e9c6e7d (alike requests planned from the engine's rates; c8 = the old weight on this pair):
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 32 3 a8,c8,k4 > $R/alike-t0-b32.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0.8 32 3 a8,c8,k4,k5 > $R/alike-t08-b32.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 64 3 a8,c8,k4 > $R/alike-t0-b64.txt
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
PAIR=random SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 32 3 nospec,a8,c8 > $R/alike-random-t0-b32.txt
PAIR=random SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0.8 32 3 nospec,a8,c8 > $R/alike-random-t08-b32.txt
python $R/memo_timing.py > $R/memo_timing.txt  # the plan search with its memo (cdb36a7) and without
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/kmax.py 0 32 3 a8,a6,a4,k4 > $R/kmax-after-t0-b32.txt  # after e9c6e7d
