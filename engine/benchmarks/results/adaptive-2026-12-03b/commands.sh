set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-03b
T=engine/benchmarks/results/adaptive-2026-12-03/trace_site  # the step tracer (diagnostic)
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# At cf10b7a (the draft's forwards priced by sequence count): served greedy c32 and c64, 3 interleaved repeats,
# every step traced (trace-sweep-greedy-default.txt; python $R/explore_cost.py /tmp/sw/trace sums the explorations).
SPECSERVE_TRACE_FILE=/tmp/sw/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$T:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c32-64
# At b6332d6 (token ids streamed for a model without a tokenizer: TTFT / TPOT reported): T = 0.8, not traced.
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-t08-c32-64
