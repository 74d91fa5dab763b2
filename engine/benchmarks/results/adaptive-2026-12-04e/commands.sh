# Results 12-04e. Each from the repository root, one torch thread, an empty profile cache (a cold start).
F=engine/benchmarks/results/adaptive-2026-12-04e/flow.py
R=engine/benchmarks/results/adaptive-2026-12-04e
export OMP_NUM_THREADS=1
fresh() { SPECSERVE_CACHE_DIR=$(mktemp -d) "$@"; }
# at 78ebfba (the policy at the start of the session):
fresh python $F 0 32 192 a8,k4,nospec > $R/flow-t0-c32.txt
fresh python $F 0 64 256 a8,k4,nospec > $R/flow-t0-c64.txt
fresh python $F 0.8 32 192 a8,k4,k5,nospec > $R/flow-t08-c32.txt
fresh python $F 0.8 64 256 a8,k4,k5,nospec > $R/flow-t08-c64.txt
fresh python $R/flow_reasons.py 0.8 32 128 5 > $R/reasons-t08-c32-78ebfba.txt  # the script's first version
# at 010951d (a plain-decode lead held only while plain decode's price keeps it; o8: held as before):
fresh python $F 0.8 32 192 a8,o8,k5 > $R/lead-t08-c32.txt
fresh python $F 0 32 192 a8,o8,k4 > $R/lead-t0-c32.txt
fresh python $F 0 32 192 a8,e8,k4 > $R/prior-t0-c32.txt
fresh python $R/flow_reasons.py 0 32 192 4 > $R/reasons-t0-c32-010951d.txt
# at 358fb0e (the profiled points calibrated by the first live steps; u8: not, as before):
fresh python $F 0.8 32 192 a8,u8,k5 > $R/calib-t08-c32.txt
fresh python $F 0 32 192 a8,u8,k4 > $R/calib-t0-c32.txt
fresh python $R/flow_reasons.py 0.8 32 96 5 > $R/reasons-t08-c32-358fb0e.txt
# served, interleaved (sweep-builtin-greedy/command-and-log.txt has the exact command)
fresh python $R/flow_reasons.py 0 64 192 4 > $R/reasons-t0-c64-358fb0e.txt  # beside final-random-t0-c32 (2 jobs)
# at 358fb0e (profiled points moved half way by the first live measure):
fresh python $F 0 64 256 a8,k4,nospec > $R/half-t0-c64.txt
fresh python $F 0.8 64 256 a8,k4,k5,nospec > $R/half-t08-c64.txt
PAIR=random fresh python $F 0 32 128 a8,k2,nospec > $R/half-random-t0-c32.txt
PAIR=random fresh python $F 0.8 32 128 a8,k2,nospec > $R/half-random-t08-c32.txt
# at b667d58 (a profiled point's first live measure replaces it; u8: no calibration at all, as before 358fb0e; reverted in efa6100):
fresh python $F 0 64 256 a8,u8,k4 > $R/full-t0-c64.txt
PAIR=random fresh python $F 0 32 128 a8,u8,nospec > $R/full-random-t0-c32.txt
fresh python $F 0.8 32 192 a8,u8,k5 > $R/full-t08-c32.txt
# the landed policy (fa6cb13: 010951d's policy):
fresh python $F 0.8 64 256 a8,k4,k5,nospec > $R/landed-t08-c64.txt
PAIR=random fresh python $F 0.8 32 128 a8,k2,nospec > $R/landed-random-t08-c32.txt
fresh python $F 0 64 256 a8,k4,nospec > $R/landed-t0-c64.txt
fresh python $F 0 32 192 a8,k4,nospec > $R/landed-t0-c32.txt   # twice: landed-t0-c32-2.txt
