#!/usr/bin/env bash
# Container entry point: `IMAGE trainer [flags]` or `IMAGE aux [flags]`; flags go to the peer unchanged
# and override the defaults below (argparse keeps the last value given).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
data="${LEANHIVE_DATA:-/data}"
p2p_port="${LEANHIVE_P2P_PORT:-31337}"
metrics_port="${LEANHIVE_METRICS_PORT:-9100}"
listen_host="${LEANHIVE_LISTEN_HOST:-0.0.0.0}"  # p2p and metrics; tests use 127.0.0.1
python="${LEANHIVE_PYTHON:-python}"

usage() {
  cat <<USAGE
usage: IMAGE trainer [trainer flags]   train with the swarm (see: IMAGE trainer --help)
       IMAGE aux [aux peer flags]      checkpoints, metrics and dashboard (see: IMAGE aux --help)
Persistent files (identity keys, backups, checkpoints) live in ${data}; mount a volume there.
USAGE
}

role="${1:-}"
[ $# -gt 0 ] && shift
case "$role" in
  trainer)
    export LEANHIVE_ROLE=trainer
    exec "$python" "$here/run_trainer.py" \
      --host_maddrs "/ip4/${listen_host}/tcp/${p2p_port}" \
      --identity_path "${data}/trainer_identity.key" \
      --output_dir "${data}/trainer" "$@"
    ;;
  aux)
    export LEANHIVE_ROLE=aux
    exec "$python" "$here/run_aux_peer.py" \
      --host_maddrs "/ip4/${listen_host}/tcp/${p2p_port}" \
      --identity_path "${data}/aux_identity.key" \
      --checkpoint_dir "${data}/checkpoints" \
      --metrics_host "${listen_host}" \
      --metrics_port "${metrics_port}" "$@"
    ;;
  -h|--help|help)
    usage
    ;;
  *)
    echo "unknown role '${role}': expected 'trainer' or 'aux'" >&2
    usage >&2
    exit 2
    ;;
esac
