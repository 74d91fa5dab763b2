set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-02g
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# Built-in pair, batch 1, after 669502b: builtin-b1-idle.txt; at 6b29b15: builtin-b1-head{,-2,-3}.txt; at d12c5e6:
# builtin-b1-after-prefix-skip{,-2,-3}.txt (the same command, run three times).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0,0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/builtin-b1-head.txt
# Batch 1 per request on a fresh engine (the diagnostic that found the stuck engine-wide depth rates).
SPECSERVE_CACHE_DIR=$(mktemp -d) python $R/b1diag.py
# In-process closed loop, c64, greedy: before bc87104 (inproc-c64-greedy-noprefillexplore.txt, with EXPLDEBUG=1),
# after 6b29b15 (inproc-c64-greedy-prefillcurves.txt, 2 repeats; inproc-c64-greedy-head.txt, 4 repeats), and
# speculation configured but every round forced plain (inproc-c64-greedy-forced-plain.txt).
SPECSERVE_CACHE_DIR=$(mktemp -d) VERBOSE=1 CONFIGS="none=none;ad=adaptive" T=0 python $R/served.py 64 128 48 4 > $R/inproc-c64-greedy-head.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) CONFIGS="none=none;fp=adaptive" T=0 python $R/served.py 64 128 48 4 > $R/inproc-c64-greedy-forced-plain.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) VERBOSE=1 CONFIGS="none=none;ad=adaptive" T=0 python $R/served.py 32 96 48 3 > $R/inproc-c32-greedy-head.txt
# Served greedy, c32 and c64, 3 interleaved repeats, a fresh profile cache (sweep-greedy-c32-64/; session 14's
# run of the same command is sweep-greedy-c32-64-first/).
CACHE=$(mktemp -d)
SPECSERVE_CACHE_DIR=$CACHE specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c32-64
# Served c32 with every engine step traced. trace-c32-warm-cache-*.txt: both configurations, 2 repeats, from a copy
# of the profile cache the sweep above left; trace-c32-fresh-cache*.txt: default only, 3 repeats
# (one server), a fresh cache. phases.py summarises a trace.
cp -r $CACHE $CACHE-copy
SPECSERVE_TRACE_FILE=/tmp/warm/trace SPECSERVE_CACHE_DIR=$CACHE-copy PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 2 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/warm/out
SPECSERVE_TRACE_FILE=/tmp/fresh/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/fresh/out
python $R/phases.py $R/trace-c32-fresh-cache.txt
# Served T = 0.8, c32 and c64 (sweep-t08-c32-64/).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-t08-c32-64
