#!/usr/bin/env bash
# Start the Ray head node of a specserve cluster on this machine.
#
#   deploy/start_head.sh                    # Ray detects the GPUs itself
#   deploy/start_head.sh --num-gpus=0       # extra flags go to `ray start` (e.g. keep the head for the driver)
#
# Environment:
#   SPECSERVE_VENV       virtualenv with specserve installed (default: the repository's .venv)
#   RAY_PORT             GCS port the workers join on (default 6379)
#   RAY_AUTH_MODE        "token" (default here) or "disabled"; with "token" the token is created in
#                        ~/.ray/auth_token and every worker node needs the same one (see start_worker.sh)
#   RAY_DASHBOARD_HOST   where the dashboard listens (default 127.0.0.1)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECSERVE_VENV:-$repo/.venv}"
port="${RAY_PORT:-6379}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

if [[ ! -x "$venv/bin/ray" ]]; then
    echo "start_head.sh: no ray in $venv (set SPECSERVE_VENV, or: python3 -m venv .venv && .venv/bin/pip install -e .)" >&2
    exit 2
fi
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
    "$venv/bin/ray" get-auth-token --generate >/dev/null
fi

"$venv/bin/ray" start --head --port="$port" --dashboard-host="${RAY_DASHBOARD_HOST:-127.0.0.1}" "$@"

ip="${RAY_HEAD_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
echo
echo "Head is up at $ip:$port. On every worker node:"
if [[ "$RAY_AUTH_MODE" == "token" ]]; then
    echo "    RAY_AUTH_TOKEN=<contents of ~/.ray/auth_token on this node> deploy/start_worker.sh $ip:$port"
else
    echo "    RAY_AUTH_MODE=disabled deploy/start_worker.sh $ip:$port"
fi
echo "Then, on this node (RAY_AUTH_MODE=$RAY_AUTH_MODE in the environment):"
echo "    specserve generate --address auto --tensor-parallel-size N --target DIR ... --input in.jsonl --output out.jsonl"
