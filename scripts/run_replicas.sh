#!/usr/bin/env bash
# N replicas of veloxquant-serve on loopback, with nginx (config/nginx-replicas.conf) in front.
#
#   scripts/run_replicas.sh N [--model M] [--base-port P] [--lb-port L] [--log-dir D]
#
#   N            replicas to start (1..64)
#   --model M    what each replica serves (default: tiny, the offline test model)
#   --base-port  replica i listens on 127.0.0.1:P+i-1 (default 8001)
#   --lb-port    the balancer's port on 127.0.0.1 (default 8080)
#   --log-dir    where replica-I.log, nginx.conf and nginx-error.log go (default: a new temp dir)
#
# Waits until every replica and the balancer answer GET /health with 200, prints one line per
# replica and one for the balancer, then "ready", and keeps running. The balancer serves
# /v1/* and /health only; /admin/* and /metrics stay on each replica's own port.
#
# Ctrl-C or SIGTERM stops everything cleanly: SIGTERM to each replica (each drains: new
# requests get 503, those in flight finish, up to server.shutdown_grace_s), then nginx stops
# gracefully once they have exited; the exit status is 0 when every replica exited 0. A second
# Ctrl-C or SIGTERM cuts the drain short. A replica that exits on its own (a SIGTERM sent to it
# alone: a rolling restart) is reported with its exit status; the balancer routes around it.
#
# Replica settings come from config/default.toml and VELOXQUANT_* variables, as for one
# server; only --host, --port and --model are set here. The replicas do not share a pool:
# size each one's pool for one replica's share of the machine (docs/operations.md, "Scaling out").
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONF_TEMPLATE="$ROOT/config/nginx-replicas.conf"
STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-180}"   # model load (the default model converts once)
STOP_TIMEOUT_S="${STOP_TIMEOUT_S:-60}"          # > server.shutdown_grace_s (30 s) + exit

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
die() { echo "run_replicas: $*" >&2; exit 2; }

N="${1:-}"
[ -n "$N" ] && [ "${N#-}" = "$N" ] || usage
shift
MODEL=tiny BASE_PORT=8001 LB_PORT=8080 LOG_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="${2:?--model needs a value}"; shift 2 ;;
    --base-port) BASE_PORT="${2:?--base-port needs a value}"; shift 2 ;;
    --lb-port) LB_PORT="${2:?--lb-port needs a value}"; shift 2 ;;
    --log-dir) LOG_DIR="${2:?--log-dir needs a value}"; shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
case "$N$BASE_PORT$LB_PORT" in *[!0-9]*) die "N and the ports must be numbers" ;; esac
[ "$N" -ge 1 ] && [ "$N" -le 64 ] || die "N must be 1..64"

NGINX="$(command -v nginx || true)"
for candidate in /usr/sbin/nginx /usr/local/sbin/nginx; do
  [ -z "$NGINX" ] && [ -x "$candidate" ] && NGINX="$candidate"
done
[ -n "$NGINX" ] || die "nginx not found: apt-get install nginx-light (scripts/install_test_tools.sh)"
command -v curl >/dev/null 2>&1 || die "curl not found (used for the health checks)"
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
[ -z "$PY" ] && PY="python3"

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for ((i = 0; i < N; i++)); do
  port_busy $((BASE_PORT + i)) && die "port $((BASE_PORT + i)) is in use (pick another --base-port)"
done
port_busy "$LB_PORT" && die "port $LB_PORT is in use (pick another --lb-port)"

[ -n "$LOG_DIR" ] || LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-replicas.XXXXXX")"
mkdir -p "$LOG_DIR/nginx-temp" || die "cannot create $LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"

# Each upstream list between BEGIN/END markers (least_conn, and by session) becomes these N replicas (with
# the parameters of the shipped lines); the temp paths keep nginx out of /var/lib/nginx,
# so the script also runs as a plain user.
render_config() {
  awk -v n="$N" -v base="$BASE_PORT" -v lb="$LB_PORT" -v tmp="$LOG_DIR/nginx-temp" '
    /# BEGIN replicas/ { print; skip = 1; next }
    skip && /^ *server / && params == "" {
      # The shipped lines'"'"' parameters (max_fails, fail_timeout) go on every replica.
      params = $0
      sub(/^ *server [^ ;]+/, "", params)
      next
    }
    /# END replicas/ {
      for (i = 0; i < n; i++) printf "        server 127.0.0.1:%d%s\n", base + i, params
      skip = 0
    }
    skip { next }
    /^http \{/ {
      print
      k = split("client_body proxy fastcgi uwsgi scgi", kinds, " ")
      for (j = 1; j <= k; j++) printf "    %s_temp_path %s/%s;\n", kinds[j], tmp, kinds[j]
      next
    }
    /listen 127\.0\.0\.1:8080;/ { sub(/127\.0\.0\.1:8080/, "127.0.0.1:" lb) }
    { print }
  ' "$CONF_TEMPLATE" > "$LOG_DIR/nginx.conf"
}
render_config || die "cannot render $LOG_DIR/nginx.conf"
# Level warn: the error log then records each retry and each replica taken out
# ("upstream server temporarily disabled"), which is what an operator looks for.
NGINX_ARGS=(-p "$LOG_DIR" -c "$LOG_DIR/nginx.conf"
            -g "daemon off; pid $LOG_DIR/nginx.pid; error_log $LOG_DIR/nginx-error.log warn;")
"$NGINX" -t -q "${NGINX_ARGS[@]}" || die "nginx -t failed on $LOG_DIR/nginx.conf"

# Job control: each child gets its own process group, so a Ctrl-C in the terminal reaches
# this script alone (which then drains the replicas) instead of stopping them all at once.
set -m
PIDS=()       # replica i's pid, "" before it starts and once its exit has been reported
for ((i = 0; i < N; i++)); do PIDS[i]=""; done
LIVE=0        # replicas still running, as of the last reap_all
STATUS=0      # becomes 1 when a replica exits non-zero or has to be killed
NGINX_PID=""
STOPPING=0

# reap_all: report each replica that has exited (with its exit status) and count the rest.
# Not called in $(...): a subshell could neither wait for our children nor update PIDS.
reap_all() {
  local i pid rc
  LIVE=0
  for ((i = 0; i < N; i++)); do
    pid="${PIDS[$i]}"
    [ -n "$pid" ] || continue
    if kill -0 "$pid" 2>/dev/null; then
      LIVE=$((LIVE + 1))
      continue
    fi
    wait "$pid"; rc=$?
    echo "replica $((i + 1)) (pid $pid) exited with status $rc"
    [ "$rc" -eq 0 ] || STATUS=1
    PIDS[i]=""
  done
}

signal_replicas() {
  local i
  for ((i = 0; i < N; i++)); do
    [ -n "${PIDS[$i]}" ] && kill -TERM "${PIDS[$i]}" 2>/dev/null
  done
}

stop_all() {
  local i deadline
  if [ "$STOPPING" -eq 1 ]; then
    # Second signal: SIGTERM again takes uvicorn's immediate path (no drain).
    echo "second signal: stopping the replicas without waiting for the drain"
    signal_replicas
    return
  fi
  STOPPING=1
  echo "stopping: SIGTERM to each replica (they drain), then nginx"
  signal_replicas
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  reap_all
  while [ "$LIVE" -gt 0 ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2 & wait $!
    reap_all
  done
  for ((i = 0; i < N; i++)); do
    if [ -n "${PIDS[$i]}" ]; then
      echo "replica $((i + 1)) (pid ${PIDS[$i]}) still running after ${STOP_TIMEOUT_S}s: killed"
      kill -KILL "${PIDS[$i]}" 2>/dev/null; wait "${PIDS[$i]}" 2>/dev/null
      PIDS[i]=""; STATUS=1
    fi
  done
  if [ -n "$NGINX_PID" ] && kill -0 "$NGINX_PID" 2>/dev/null; then
    kill -QUIT "$NGINX_PID"    # graceful: open client connections finish first
    deadline=$((SECONDS + 10))
    while kill -0 "$NGINX_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.1
    done
    kill -KILL "$NGINX_PID" 2>/dev/null
    wait "$NGINX_PID" 2>/dev/null
  fi
  echo "stopped (logs in $LOG_DIR)"
  exit "$STATUS"
}
trap stop_all INT TERM
# A shell started with SIGINT ignored (a background job of another script) cannot trap it.
if [ "$(trap -p INT)" = "trap -- '' SIGINT" ]; then
  echo "run_replicas: SIGINT is ignored in this process (started in the background?): stop it with SIGTERM"
fi

for ((i = 0; i < N; i++)); do
  port=$((BASE_PORT + i))
  "$PY" -m server --host 127.0.0.1 --port "$port" --model "$MODEL" \
    > "$LOG_DIR/replica-$((i + 1)).log" 2>&1 < /dev/null &
  PIDS[i]=$!
done
"$NGINX" "${NGINX_ARGS[@]}" < /dev/null &
NGINX_PID=$!
set +m  # the children keep their process groups; this only silences bash's job notices

# wait_healthy URL NAME: poll GET URL/health until 200, bounded by STARTUP_TIMEOUT_S.
wait_healthy() {
  local deadline=$((SECONDS + STARTUP_TIMEOUT_S)) code
  while [ "$SECONDS" -lt "$deadline" ]; do
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1/health")"
    [ "$code" = "200" ] && return 0
    reap_all
    [ "$LIVE" -eq "$N" ] || { echo "run_replicas: a replica exited during start-up" >&2; return 1; }
    kill -0 "$NGINX_PID" 2>/dev/null || { echo "run_replicas: nginx exited" >&2; return 1; }
    sleep 0.2 & wait $!
  done
  echo "run_replicas: $2 not healthy after ${STARTUP_TIMEOUT_S}s" >&2
  return 1
}
for ((i = 0; i < N; i++)); do
  url="http://127.0.0.1:$((BASE_PORT + i))"
  wait_healthy "$url" "replica $((i + 1))" || { STATUS=1; tail -n 20 "$LOG_DIR"/replica-*.log >&2; stop_all; }
  echo "replica $((i + 1)): $url (pid ${PIDS[$i]}, log $LOG_DIR/replica-$((i + 1)).log)"
done
wait_healthy "http://127.0.0.1:$LB_PORT" "the balancer" || { STATUS=1; stop_all; }
echo "balancer: http://127.0.0.1:$LB_PORT (pid $NGINX_PID; public: /v1/*, /health)"
echo "ready"

# Watch: report replicas that exit on their own; stop everything when none is left or nginx dies.
while :; do
  reap_all
  if [ "$LIVE" -eq 0 ]; then
    echo "no replica left"
    stop_all
  fi
  if ! kill -0 "$NGINX_PID" 2>/dev/null; then
    echo "nginx exited (see $LOG_DIR/nginx-error.log)"
    STATUS=1
    NGINX_PID=""
    stop_all
  fi
  sleep 0.5 & wait $!   # a background sleep: a trapped signal interrupts the wait at once
done
