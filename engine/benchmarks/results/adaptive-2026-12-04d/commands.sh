# Results 12-04d. Each from the repository root, one torch thread, an empty profile cache (a cold start).
# The random pair: python -c "from engine.benchmarks.random_pair import make_random_pair; make_random_pair('runs/random-pair', 1024, 12, 32000)"
K=engine/benchmarks/results/adaptive-2026-12-04c/kmax.py
export OMP_NUM_THREADS=1
fresh() { SPECSERVE_CACHE_DIR=$(mktemp -d) "$@"; }
fresh python $K 0 32 3 a8,k4,k4_2 > noise-t0-b32.txt
fresh python engine/benchmarks/results/adaptive-2026-12-04d/phases.py 32 0 3 a8,k4 > phases-t0-b32.txt
MT=160 fresh python engine/benchmarks/results/adaptive-2026-12-04d/forced.py 32 0,2,3,4,5,6,8
# neighbour-shape.diff applied, with an o8 variant pricing on the all-steps shape (the code before it):
fresh python $K 0 32 3 a8,o8,k4 > shape-t0-b32.txt   # and again: shape2-t0-b32.txt
# spec_margin (before the profiling change; a8 then had 0.05, today's f8):
fresh python $K 0 32 3 f8,m8,h8,k4 > margin-t0-b32.txt
fresh python $K 0.8 32 3 f8,h8,m8,k4,k5 > margin-t08-b32.txt
fresh python $K 0 64 3 f8,h8,m8,k4 > margin-t0-b64.txt
PAIR=random fresh python $K 0.8 32 3 nospec,f8,h8,m8 > margin-random-t08-b32.txt
PAIR=random fresh python $K 0 32 3 nospec,f8,h8,m8 > margin-random-t0-b32.txt
fresh python engine/benchmarks/results/adaptive-2026-12-04c/reasons.py 0 64 2 4 -v > reasons-margin2.5-t0-b64.txt  # with spec_margin 0.025
# after the profiling change (engine/policy_warmup.py, adaptive_warmup_s 5):
fresh python $K 0 64 3 a8,k4 > warm-t0-b64.txt
fresh python $K 0 32 3 a8,k4 > warm-t0-b32.txt
fresh python $K 0.8 32 3 a8,k4,k5 > warm-t08-b32.txt
PAIR=random fresh python $K 0 32 3 nospec,a8 > warm-random-t0-b32.txt
PAIR=random fresh python $K 0.8 32 3 nospec,a8 > warm-random-t08-b32.txt
fresh python $K 0 1 1 a8,k4,k6,k8 > warm-t0-b1.txt
# the old code for comparison (a worktree of 1ce5ae3, runs/ linked in):
#   git worktree add /tmp/old 1ce5ae3 && cd /tmp/old && ln -s /work/main/runs runs
#   PYTHONPATH=/tmp/old fresh python $K 0.8 64 3 a8,k4,k5 > before-t08-b64.txt
fresh python $K 0 32 3 a8,k4 > warm2-t0-b32.txt
fresh python $K 0.8 64 3 a8,k4,k5 > warm-t08-b64.txt
# the kept version (both regimes per batch size, 10 s):
fresh python $K 0.8 64 3 a8,k4,k5 > both-t08-b64.txt
fresh python $K 0 64 3 a8,k4 > both-t0-b64.txt
fresh python $K 0 32 3 a8,k4 > both-t0-b32.txt
PAIR=random fresh python $K 0 32 3 nospec,a8 > both-random-t0-b32.txt
fresh python $K 0.8 32 3 a8,k4,k5 > both-t08-b32.txt
PAIR=random fresh python $K 0.8 32 3 nospec,a8 > both-random-t08-b32.txt
fresh python $K 0 1 1 a8,k4,k6,k8 > both-t0-b1.txt
