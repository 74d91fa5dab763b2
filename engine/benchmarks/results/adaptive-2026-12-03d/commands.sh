set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-03d
T=engine/benchmarks/results/adaptive-2026-12-03/trace_site  # the step tracer (diagnostic)
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
# In one process, lockstep: no speculation and the adaptive default step in turn, each timed by its own steps;
# 64 prompts x 48 tokens at batch 32 and 64, T = 0.8 then greedy, 3 repeats. lockstep-before.txt at 9dea39e,
# lockstep-after.txt (traced) at 2406c7f (exploration odds from plain decode).
SPECSERVE_TRACE_FILE=/tmp/ls2/trace PYTHONPATH=$T:. SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --target runs/random-pair/target --draft runs/random-pair/draft --num-prompts 64 --max-tokens 48 --batches 32,64 --temperatures 0.8,0 --unseeded --repeats 3 --skip-hf --skip-floor --modes specserve_nospec,specserve_adaptive --threads 1 --lockstep > $R/lockstep-after.txt
# The trace's lines of each engine (the adaptive one reports what its cost model was told, "OBS"), then what its
# speculative steps gained or lost against its plain steps around them.
mkdir -p /tmp/ls2/split && grep OBS /tmp/ls2/trace.* > /tmp/ls2/split/t.adaptive && grep -v OBS /tmp/ls2/trace.* > /tmp/ls2/split/t.nospec
python engine/benchmarks/results/adaptive-2026-12-03c/spec_cost.py /tmp/ls2/split/t > $R/spec-cost-lockstep-after.txt
# Served, concurrency 64, T = 0.8, 3 interleaved repeats, both servers traced (at b672745).
SPECSERVE_TRACE_FILE=/tmp/sv/trace PYTHONPATH=$T:. SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench sweep --interleave --repeats 3 --server-args "--target runs/random-pair/target" --config nospec=none --config 'default={"model": "runs/random-pair/draft"}' --concurrency 64 --prompts-per-concurrency 2 --num-prompts 4 --random-input-len 32 --output-len 48 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-t0.8-c64 2> $R/sweep-t0.8-c64.log
python engine/benchmarks/results/adaptive-2026-12-03c/spec_cost.py /tmp/sv/trace > $R/spec-cost-served-t0.8.txt
