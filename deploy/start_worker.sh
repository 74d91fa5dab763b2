#!/usr/bin/env bash
# Join this machine to a specserve Ray cluster started with deploy/start_head.sh.
#
#   RAY_AUTH_TOKEN=... deploy/start_worker.sh HEAD_IP:PORT [ray start flags, e.g. --num-gpus=8 --block]
#
# Environment:
#   SPECSERVE_VENV   virtualenv with specserve installed, the same version as on the head (default: the
#                    repository's .venv); Ray actors import specserve from here
#   RAY_AUTH_MODE    "token" (default) or "disabled": must match the head
#   RAY_AUTH_TOKEN   the head's token (its ~/.ray/auth_token), unless this node has the same file already
#
# Model directories are read by the workers on their own node: make them available at the same path on
# every node (a shared filesystem, or a copy).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 HEAD_IP:PORT [ray start flags]" >&2
    exit 2
fi
address="$1"
shift

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECSERVE_VENV:-$repo/.venv}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

if [[ ! -x "$venv/bin/ray" ]]; then
    echo "start_worker.sh: no ray in $venv (set SPECSERVE_VENV)" >&2
    exit 2
fi
if [[ "$RAY_AUTH_MODE" == "token" && -z "${RAY_AUTH_TOKEN:-}" && ! -s "$HOME/.ray/auth_token" ]]; then
    echo "start_worker.sh: the head uses token authentication: set RAY_AUTH_TOKEN to the head's ~/.ray/auth_token" >&2
    exit 2
fi

exec "$venv/bin/ray" start --address="$address" "$@"
