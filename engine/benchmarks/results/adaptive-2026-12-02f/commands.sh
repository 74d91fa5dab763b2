set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-02f
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# Before (HEAD b461b84), the larger pair served at c32 and c64, 4 requests a slot, 3 repeats (stopped after the c32
# runs, whose log is sweep-before-c32-log.txt: the server's chosen depths were read from its /metrics).
specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 4 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/sat1/out
# The same workload in-process at c32 with every speculative step traced (a fresh profile folder each run):
# inproc-c32-before.txt (b461b84, served.py of adaptive-2026-12-02e), inproc-c32-cold-turns.txt (5e1db9e),
# inproc-c32-cold-turns-tokens.txt (5e1db9e, with the tokens each step emitted, which served.py prints since).
SPECSERVE_CACHE_DIR=$(mktemp -d) CONFIGS="none=none;ad=adaptive" T=0.8 VERBOSE=1 python engine/benchmarks/results/adaptive-2026-12-02e/served.py 32 128 48 1
# After (f2a009a: the cold turns and the kept profile), the larger pair served, T = 0.8, c1-64, 3 interleaved
# repeats, a fresh profile cache (rm -rf ~/.cache/specserve first).
specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 1,16,32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-h1024-t08
# Built-in pair, batch 1, greedy and T = 0.8 (447926a).
specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0,0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6 --threads 1 > $R/builtin-b1.txt
