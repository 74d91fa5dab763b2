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
# Built-in pair, batch 1 (builtin-b1-first.txt: 8 prompts, 3 repeats, at b6332d6; builtin-b1.txt: 4 prompts,
# 6 repeats, at 94cf7d6: ratios also per repeat). Tests ran beside repeats 2-3 of T = 0.8 in the second.
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0,0.8 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/builtin-b1-first.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 4 --max-tokens 128 --batches 1 --temperatures 0,0.8 --unseeded --repeats 6 --skip-hf --skip-floor --modes specserve_chain,specserve_adaptive --k 4 --fixed-ks 2,6,8 --threads 1 > $R/builtin-b1.txt
# At 6e24dce (the search skipped behind a wide lead of plain decode): served greedy c64, 3 interleaved repeats,
# traced (trace-c64-greedy-default.txt).
SPECSERVE_TRACE_FILE=/tmp/c64/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$T:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-greedy-c64-skip
# The plan's time per step on the curves that c64 server measured (c64-greedy-profile.json), at the 5 % threshold.
OMP_NUM_THREADS=1 python $R/plan_bench.py > $R/plan_bench.txt
