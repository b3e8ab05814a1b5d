#!/usr/bin/env bash
# A single-node Garage (S3-compatible server) on loopback for the S3 tests.
#
#   scripts/garage.sh start   start a fresh node, make a bucket and a key, print the exports
#   scripts/garage.sh env     print the exports of the running node
#   scripts/garage.sh stop    stop the node (its data stays under .cache/garage until the next start)
#
# Everything lives under .cache/garage/ (ignored by git): the config (with a secret
# generated per start), metadata and data, the log, the pid and the env file.
# The server binds 127.0.0.1 only. Use it as:
#   eval "$(scripts/garage.sh start)"; ...; scripts/garage.sh stop
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="$PWD/.cache/garage"
CFG="$DIR/garage.toml"
PIDFILE="$DIR/garage.pid"
ENVFILE="$DIR/env"
BUCKET="${CKPT_GARAGE_BUCKET:-ckpt-test}"
REGION="garage"
GARAGE="${GARAGE:-$(command -v garage || echo "$HOME/.cargo/bin/garage")}"

log() { printf '[garage] %s\n' "$*" >&2; }
g() { "$GARAGE" -c "$CFG" "$@"; }
# Admin commands right after start can race the node's own startup: retry a few times.
g_retry() {
  local i
  for i in $(seq 1 10); do
    g "$@" 2>/dev/null && return 0
    sleep 0.5
  done
  g "$@"
}

running() {
  [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

secret_hex() {
  if command -v openssl >/dev/null; then openssl rand -hex 32; else head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; fi
}

stop() {
  if running; then
    local pid; pid=$(cat "$PIDFILE")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    log "stopped (pid $pid)"
  fi
  rm -f "$PIDFILE" "$ENVFILE"
}

start() {
  [ -x "$GARAGE" ] || { log "garage not found (run scripts/setup.sh)"; exit 1; }
  stop
  rm -rf "$DIR"
  mkdir -p "$DIR/meta" "$DIR/data"
  local rpc_port s3_port
  rpc_port=$(free_port)
  s3_port=$(free_port)
  while [ "$s3_port" = "$rpc_port" ]; do s3_port=$(free_port); done
  umask 077
  cat >"$CFG" <<EOF
metadata_dir = "$DIR/meta"
data_dir = "$DIR/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$rpc_port"
rpc_public_addr = "127.0.0.1:$rpc_port"
rpc_secret = "$(secret_hex)"

[s3_api]
s3_region = "$REGION"
api_bind_addr = "127.0.0.1:$s3_port"
root_domain = ".s3.garage.localhost"
EOF
  chmod 600 "$CFG"
  RUST_LOG="${GARAGE_LOG:-garage=warn}" nohup "$GARAGE" -c "$CFG" server >"$DIR/garage.log" 2>&1 &
  echo $! >"$PIDFILE"

  # Wait (bounded) for the node to answer admin RPC.
  local node=""
  for _ in $(seq 1 100); do
    running || { log "server exited; log:"; tail -20 "$DIR/garage.log" >&2; exit 1; }
    node=$(g node id -q 2>/dev/null || true)
    [ -n "$node" ] && break
    sleep 0.2
  done
  [ -n "$node" ] || { log "server did not answer in 20 s"; stop; exit 1; }
  # `node id` can answer from the key file the server writes before its RPC
  # listener is up; wait until a real RPC round trip (`status`) succeeds.
  local up=""
  for _ in $(seq 1 100); do
    running || { log "server exited; log:"; tail -20 "$DIR/garage.log" >&2; exit 1; }
    if g status >/dev/null 2>&1; then up=1; break; fi
    sleep 0.2
  done
  [ -n "$up" ] || { log "RPC did not answer in 20 s; log:"; tail -20 "$DIR/garage.log" >&2; stop; exit 1; }

  g_retry layout assign -z dc1 -c 1G "${node%%@*}" >/dev/null
  g_retry layout apply --version 1 >/dev/null
  g_retry bucket create "$BUCKET" >/dev/null
  local key_out key_id secret
  key_out=$(g key create ckpt-test-key)
  key_id=$(printf '%s\n' "$key_out" | awk -F': *' '/Key ID/ {print $2; exit}' | tr -d ' ')
  secret=$(printf '%s\n' "$key_out" | awk -F': *' '/Secret key/ {print $2; exit}' | tr -d ' ')
  [ -n "$key_id" ] && [ -n "$secret" ] || { log "could not parse the key:"; printf '%s\n' "$key_out" >&2; stop; exit 1; }
  g bucket allow --read --write --owner "$BUCKET" --key "$key_id" >/dev/null

  # Wait (bounded) until the S3 endpoint accepts connections.
  for _ in $(seq 1 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$s3_port") 2>/dev/null && break
    sleep 0.1
  done

  cat >"$ENVFILE" <<EOF
export AWS_ACCESS_KEY_ID=$key_id
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_ENDPOINT=http://127.0.0.1:$s3_port
export AWS_REGION=$REGION
export AWS_DEFAULT_REGION=$REGION
export AWS_ALLOW_HTTP=true
export CKPT_S3_BUCKET=$BUCKET
EOF
  log "node ${node%%@*} up: S3 on 127.0.0.1:$s3_port, bucket $BUCKET"
  cat "$ENVFILE"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env)
    running && [ -f "$ENVFILE" ] || { log "not running (use: $0 start)"; exit 1; }
    cat "$ENVFILE"
    ;;
  *)
    echo "usage: $0 start|stop|env" >&2
    exit 2
    ;;
esac
