set -ex
# Issue 14's criteria at one commit, in lockstep (the engine modes step in turn in one process, each timed by
# its own steps), one torch thread, nothing else running. From the repository root.
. .venv/bin/activate
export OMP_NUM_THREADS=1
R=engine/benchmarks/results/adaptive-2026-12-04b
C="--unseeded --skip-hf --skip-floor --threads 1 --lockstep --modes specserve_nospec,specserve_adaptive --fixed-ks 2,4,6,8"
# Built-in pair: batch 1 (8 prompts x 128 tokens), then the ladder 8-64 (64 prompts x 64 tokens).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 8 --max-tokens 128 --batches 1 --temperatures 0,0.8 --repeats 3 $C > $R/builtin-b1.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 64 --max-tokens 64 --batches 8,16,32,64 --temperatures 0,0.8 --repeats 3 $C > $R/builtin-ladder.txt
# Larger random pair (hidden 1024, 12 layers, vocab 32k; the draft is its first layer).
python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
P="--target runs/random-pair/target --draft runs/random-pair/draft"
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare $P --num-prompts 4 --max-tokens 48 --batches 1 --temperatures 0,0.8 --repeats 3 $C > $R/random-b1.txt
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare $P --num-prompts 64 --max-tokens 48 --batches 32,64 --temperatures 0,0.8 --repeats 1 $C > $R/random-saturation.txt
# Batch 32 on the built-in pair again, 5 repeats, with the fixed chains around the best (after the diagnosis).
SPECSERVE_CACHE_DIR=$(mktemp -d) specserve bench compare --num-prompts 64 --max-tokens 64 --batches 32 --temperatures 0.8,0 --repeats 5 --unseeded --skip-hf --skip-floor --threads 1 --lockstep --modes specserve_nospec,specserve_adaptive --fixed-ks 4,5,6 > $R/builtin-b32-5repeats.txt
