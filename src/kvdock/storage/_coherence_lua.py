"""The fleet's invalidation stream in Redis (storage.coherence): its keys, its limits and the Lua
scripts that read it, append to it, and fence the L3 writes and deletions by per-key floors.
Positions are Redis stream ids ("ms-seq"); every script runs atomically on the stream's (or the
object's) node."""

from __future__ import annotations

__all__ = [
    "DELETE_SCRIPT",
    "INCARNATION_KEY",
    "ISSUE_LIMIT_MS",
    "MAXLEN",
    "POLL_COUNT",
    "POLL_SCRIPT",
    "PUBLISH_SCRIPT",
    "STREAM_KEY",
    "WRITE_SCRIPT",
]

STREAM_KEY = b"kvdock:v2:{invalidations}"
# a random id of the stream's incarnation, in its hash slot: an L3 that lost the stream (restarted
# empty, flushed) makes a new one, and every server that knew the old one sees a gap
INCARNATION_KEY = b"kvdock:v2:{invalidations}:incarnation"
MAXLEN = 100_000  # entries the stream keeps (approximately: XADD MAXLEN ~)
POLL_COUNT = 256  # entries one poll reads at most
FLOOR_TTL_MS = 60_000
ISSUE_LIMIT_MS = 10_000

# Lua: positions are "ms-seq" strings compared as two numbers (each exact in a double)
_OLDER = """
local function older(a, b)
  -- nil when either is not a position (a floor someone else wrote): the caller decides
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not (am and bm) then return nil end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
_INCARNATION = """
local function incarnation(key, fresh)
  local inc = redis.call('GET', key)
  if not inc then
    inc = fresh
    redis.call('SET', key, inc)
  end
  return inc
end
"""
# KEYS: the stream, its incarnation. ARGV: position, count, a fresh incarnation (used if there is
# none). Returns {now ms, incarnation, entries-added, last-generated-id, first entry id, length,
# entries after position}
POLL_SCRIPT = (
    _OLDER
    + _INCARNATION
    + """
local s = KEYS[1]
local now = now_ms()
local inc = incarnation(KEYS[2], ARGV[3])
if redis.call('EXISTS', s) == 0 then return {now, inc, 0, '0-0', '0-0', 0, {}} end
local info = redis.call('XINFO', 'STREAM', s)
local f = {}
for j = 1, #info, 2 do f[info[j]] = info[j + 1] end
local first = '0-0'
if type(f['first-entry']) == 'table' then first = f['first-entry'][1] end
local entries = redis.call('XRANGE', s, '(' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
return {now, inc, f['entries-added'], f['last-generated-id'], first, f['length'], entries}
"""
)
# KEYS: the stream, its incarnation. ARGV: the entry's payload, a fresh incarnation. Returns the
# entry's id.
PUBLISH_SCRIPT = (
    _INCARNATION
    + f"""
incarnation(KEYS[2], ARGV[2])
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', {MAXLEN}, '*', 'k', ARGV[1])
"""
)
# KEYS: value, floor. ARGV: floor position. Raises the floor and deletes the value, unless the
# floor is already at a later position: then another overwrite's later entry came first and what
# the value holds was written past it (its version wins; a late step of an earlier overwrite must
# not delete it). Returns the keys deleted.
DELETE_SCRIPT = (
    _OLDER
    + f"""
local f = redis.call('GET', KEYS[2])
if (not f) or older(f, ARGV[1]) ~= false then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', {FLOOR_TTL_MS})
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)
# KEYS: value, floor. ARGV: header, payload, position, issued (ms, L3's clock). 1 written, 0 refused.
WRITE_SCRIPT = (
    _OLDER
    + f"""
if now_ms() - tonumber(ARGV[4]) > {ISSUE_LIMIT_MS} then return 0 end
local f = redis.call('GET', KEYS[2])
if f and older(ARGV[3], f) ~= false then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('APPEND', KEYS[1], ARGV[2])
return 1
"""
)
