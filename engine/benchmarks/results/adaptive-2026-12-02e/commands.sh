set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-02e
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# The served workload in-process (64 in flight, 128 requests of 32 prompt tokens and 48 output tokens, T = 0.8),
# no speculation vs the adaptive default, interleaved, 3 repeats (VERBOSE=1 adds the per-step trace).
CONFIGS="none=none;ad=adaptive" T=0.8 python $R/served.py 64 128 48 3 > $R/inproc-c64-t08.txt
# Built-in pair, batch 1, T = 0.8: no regression of the low-load case.
specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6 --threads 1 > $R/builtin-b1-t08.txt
# The larger pair served, T = 0.8, concurrency 1-64, 2 interleaved repeats.
specserve bench sweep --interleave --repeats 2 --server-args "--target runs/random-pair/target" --config nospec=none --config 'k2={"model": "runs/random-pair/draft", "num_speculative_tokens": 2, "adaptive": false}' --config 'default={"model": "runs/random-pair/draft"}' --concurrency 1,16,32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-h1024-t08
