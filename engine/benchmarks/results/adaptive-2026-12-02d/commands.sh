set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-02d
# Built-in pair, in-process, batches 1 / 8 / 32, greedy and T = 0.8.
specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1,8,32 --temperatures 0,0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_nospec,specserve_chain,specserve_adaptive --k 4 --fixed-ks 6,8 --threads 1 > $R/builtin-b1-8-32.txt
# Trees at T = 0.8: a [2, 1] tree at the chain of 4's node budget, and the adaptive policy with a tree on its menu.
specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1,8 --temperatures 0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_tree,specserve_adaptive,specserve_adaptive_tree --k 4 --threads 1 > $R/trees-t08.txt
# Larger random pair (hidden 1024, 12 layers, vocab 32k; draft = its first layer), batch 32, T = 0.8, in-process,
# interleaved (ab-h1024-b32-*.txt; "f0" = the adaptive engine pinned to plain decode after start-up).
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
TARGET=runs/random-pair/target DRAFT=runs/random-pair/draft P=32 CONFIGS="none=none;ad=adaptive" python $R/ab.py 32 48 4 > $R/ab-h1024-b32-few.txt
TARGET=runs/random-pair/target DRAFT=runs/random-pair/draft P=32 CONFIGS="none=none;f0=adaptive:forced=0;ad=adaptive" python $R/ab.py 32 48 3 > $R/ab-h1024-b32-f0.txt
# Built-in pair, batch 1, T = 0.8, 5 repeats of 8 x 128 tokens (builtin-b1-t08-long.txt).
specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0.8 --unseeded --repeats 5 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/builtin-b1-t08-long.txt
# The same pair served (token-id prompts: the random pair has no tokenizer), concurrency 1-64, T = 0.8.
specserve bench sweep --interleave --repeats 1 --server-args "--target runs/random-pair/target" --config nospec=none --config 'k2={"model": "runs/random-pair/draft", "num_speculative_tokens": 2, "adaptive": false}' --config 'default={"model": "runs/random-pair/draft"}' --concurrency 1,4,16,32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-h1024-t08
# ... and greedy.
specserve bench sweep --interleave --repeats 1 --server-args "--target runs/random-pair/target" --config nospec=none --config 'k2={"model": "runs/random-pair/draft", "num_speculative_tokens": 2, "adaptive": false}' --config 'default={"model": "runs/random-pair/draft"}' --concurrency 1,4,16,32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-h1024-greedy
