set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-03c
T=engine/benchmarks/results/adaptive-2026-12-03/trace_site  # the step tracer (diagnostic)
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# Served saturation on the larger random pair, greedy then T = 0.8, c32 and c64, 3 interleaved repeats, both
# servers traced; then what the speculative steps gained or lost (spec_cost.py) per server.
for temp in 0 0.8; do
  rm -rf /tmp/sat-$temp; mkdir -p /tmp/sat-$temp
  SPECSERVE_TRACE_FILE=/tmp/sat-$temp/trace SPECSERVE_CACHE_DIR=$(mktemp -d) PYTHONPATH=$T:. specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 32,64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature $temp --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-t$temp-c32-64 2> $R/sweep-t$temp-c32-64.log
  python $R/spec_cost.py /tmp/sat-$temp/trace > $R/spec-cost-t$temp.txt
done
# In one process, the modes interleaved within each repeat (tokens per CPU-second, per-repeat pairs): 64 prompts
# at batch 64, greedy and T = 0.8, no speculation against the adaptive default.
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --target runs/random-pair/target --draft runs/random-pair/draft --num-prompts 64 --max-tokens 48 --batches 64 --temperatures 0,0.8 --unseeded --repeats 4 --skip-hf --skip-floor --modes specserve_nospec,specserve_adaptive --threads 1 > $R/b64-compare.txt
