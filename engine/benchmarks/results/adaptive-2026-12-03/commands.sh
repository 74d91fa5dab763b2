set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-03
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# Served c32 greedy, one server per configuration, every step traced (trace_site/: a sitecustomize that logs each
# step, the policy's predicted chains against plain decode, and what the cost model was told), fresh profile cache.
# Before the context-aware curves (562101b): trace-c32-greedy-before.txt (default) and trace-c32-greedy-nospec.txt.
SPECSERVE_TRACE_FILE=/tmp/fresh/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/fresh/out
SPECSERVE_TRACE_FILE=/tmp/nospec/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --concurrency 32 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/nospec/out
# At 0da92da (context-aware curves), served greedy c32 and c64, 3 interleaved repeats, traced
# (trace-sweep-greedy-{default,nospec}.txt).
SPECSERVE_TRACE_FILE=/tmp/sw/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c32-64
# ... T = 0.8 (not traced).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-t08-c32-64
# The concurrency ladder, one repeat, greedy and T = 0.8 (ladder-t0/, ladder-t0.8/).
for T in 0 0.8; do
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 1 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 1,4,16,32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature $T --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/ladder-t$T
done
# Built-in pair: trees at T = 0.8 (a [2, 1] tree at the chain of 4's node budget; the policy with a tree on its
# menu), and batch 1 adaptive against fixed depths.
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1,8 --temperatures 0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_tree,specserve_adaptive,specserve_adaptive_tree --k 4 --threads 1 > $R/trees-t08.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0,0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/builtin-b1.txt
# After 408d3f9 (still with the context-aware curves): trees again, and concurrency 16 greedy traced (the ladder's
# 0.89 there); then the same c16 server with the context slope off (ctx_min_samples = 10**9 in the clone).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1,8 --temperatures 0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_tree,specserve_adaptive,specserve_adaptive_tree --k 4 --threads 1 > $R/trees-t08-after.txt
SPECSERVE_TRACE_FILE=/tmp/c16/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 16 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c16
SPECSERVE_TRACE_FILE=/tmp/c16b/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$R/trace_site:. specserve bench sweep --interleave --repeats 2 --server-args "--target runs/random-pair/target" --config 'default={"model": "runs/random-pair/draft"}' --concurrency 16 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir /tmp/c16b/out
# At HEAD a132149 (context curves reverted): concurrency 16 greedy, 2 interleaved repeats (sweep-greedy-c16-head/).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 2 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 16 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c16-head
