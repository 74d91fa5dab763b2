set -ex
. .venv/bin/activate  # from the repository root
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-02c
specserve bench sweep --interleave --repeats 2 --config nospec=none --config 'k4={"num_speculative_tokens": 4, "adaptive": false}' --config 'default={}' --concurrency 1,2,4,8,16,32,64 --prompts-per-concurrency 2 --num-prompts 8 --output-len 64 --ignore-eos --temperature 0 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-default-greedy
specserve bench sweep --interleave --repeats 2 --config nospec=none --config 'k4={"num_speculative_tokens": 4, "adaptive": false}' --config 'default={}' --concurrency 1,2,4,8,16,32,64 --prompts-per-concurrency 2 --num-prompts 8 --output-len 64 --ignore-eos --temperature 0.8 --stop-past-knee 0 --warmup-requests 2 --no-progress --out-dir $R/sweep-default-t08
