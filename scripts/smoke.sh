#!/usr/bin/env bash
# curl smoke tests of every endpoint of a running VeloxQuant-MLX server.
#
#   scripts/smoke.sh [BASE_URL]          (default http://127.0.0.1:8000)
#
# With VELOXQUANT_ADMIN_TOKEN set (to the server's token) the admin routes are
# checked with the right token (200) and a wrong one (401); without it, they
# must answer 403. Exits non-zero on the first failed check.
set -euo pipefail

BASE_URL="${1:-${BASE_URL:-http://127.0.0.1:8000}}"
BASE_URL="${BASE_URL%/}"
TOKEN="${VELOXQUANT_ADMIN_TOKEN:-}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PASS=0

fail() { echo "FAIL: $*" >&2; [ -s "$TMP/body" ] && head -c 600 "$TMP/body" >&2 && echo >&2; exit 1; }

# request NAME EXPECTED_STATUS METHOD PATH [curl args...]: body lands in $TMP/body
request() {
  local name="$1" want="$2" method="$3" path="$4"; shift 4
  local got
  got="$(curl -sS -o "$TMP/body" -w '%{http_code}' -X "$method" --max-time 60 "$@" \
         "$BASE_URL$path")" || fail "$name: curl could not reach $BASE_URL$path"
  [ "$got" = "$want" ] || fail "$name: HTTP $got, expected $want"
}

# expect NAME PATTERN: the last body must contain PATTERN (fixed string)
expect() { grep -qF -- "$2" "$TMP/body" || fail "$1: body lacks '$2'"; PASS=$((PASS + 1)); echo "ok   $1"; }

JSON=(-H 'Content-Type: application/json')

request health 200 GET /health
expect health '"status":"ok"'

request models 200 GET /v1/models
expect models '"object":"list"'
MODEL="$(sed -n 's/.*"id":"\([^"]*\)".*/\1/p' "$TMP/body" | head -n1)"
[ -n "$MODEL" ] || fail "models: no model id"
request model 200 GET "/v1/models/$MODEL"
expect model "\"id\":\"$MODEL\""

request completion 200 POST /v1/completions "${JSON[@]}" \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"Hello\",\"max_tokens\":8,\"temperature\":0}"
expect completion '"object":"text_completion"'
expect "completion usage" '"kv_blocks":'

request chat 200 POST /v1/chat/completions "${JSON[@]}" \
  -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":8}"
expect chat '"object":"chat.completion"'
expect "chat message" '"role":"assistant"'

request "completion stream" 200 POST /v1/completions "${JSON[@]}" -N \
  -d '{"prompt":"Hello","max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}'
expect "completion stream chunks" 'data: {'
expect "completion stream usage" '"usage":'
expect "completion stream end" 'data: [DONE]'

request "chat stream" 200 POST /v1/chat/completions "${JSON[@]}" -N \
  -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"stream":true}'
expect "chat stream chunks" '"object":"chat.completion.chunk"'
expect "chat stream end" 'data: [DONE]'

request "bad input" 400 POST /v1/completions "${JSON[@]}" -d '{"prompt":"x","max_tokens":0}'
expect "bad input shape" '"error":{"message":'
request "invalid json" 400 POST /v1/completions "${JSON[@]}" -d '{"prompt":'
expect "invalid json shape" '"type":"invalid_request_error"'
request "unknown route" 404 GET /v1/nothing
expect "unknown route shape" '"error":'

request metrics 200 GET /metrics
expect "metrics pool" 'veloxquant_block_pool_blocks_in_use'
expect "metrics server" 'veloxquant_requests_total'
expect "metrics orphans" 'veloxquant_orphaned_blocks'

SHRINK='{"stream":"kv","target_free":1000000}'
if [ -n "$TOKEN" ]; then
  request "admin shrink no token" 401 POST /admin/shrink "${JSON[@]}" -d "$SHRINK"
  expect "admin shrink no token shape" '"authentication_error"'
  request "admin shrink wrong token" 401 POST /admin/shrink "${JSON[@]}" \
    -H "Authorization: Bearer wrong-$TOKEN" -d "$SHRINK"
  expect "admin shrink wrong token shape" '"authentication_error"'
  request "admin shrink" 200 POST /admin/shrink "${JSON[@]}" \
    -H "Authorization: Bearer $TOKEN" -d "$SHRINK"
  expect "admin shrink" '"retired":'
  request "admin pool" 200 GET /admin/pool -H "Authorization: Bearer $TOKEN"
  expect "admin pool" '"stats":'
else
  request "admin shrink without token" 403 POST /admin/shrink "${JSON[@]}" -d "$SHRINK"
  expect "admin shrink disabled" '"permission_error"'
  request "admin pool without token" 403 GET /admin/pool
  expect "admin pool disabled" '"permission_error"'
fi

echo "smoke: $PASS checks passed against $BASE_URL"
