"""The fleet's invalidation stream in Redis (storage.coherence): its keys, its limits and the Lua
scripts that read it, append to it, and fence the L3 writes and deletions by per-key floors.
Positions are Redis stream ids ("ms-seq"); every script runs atomically on the stream's (or the
object's) node."""

from __future__ import annotations

__all__ = [
    "CHECK_SCRIPT",
    "COMMIT_SCRIPT",
    "DELETE_SCRIPT",
    "FLOOR_MIN_MS",
    "FLOOR_TTL_MS",
    "INCARNATION_KEY",
    "ISSUE_LIMIT_MS",
    "KEEP_SCRIPT",
    "MAXLEN",
    "NONCE_SUFFIX",
    "OBJECT_TTL_MS",
    "POLL_COUNT",
    "POLL_SCRIPT",
    "SHARD_SCRIPT",
    "PUBLISH_SCRIPT",
    "STAGED_SUFFIX",
    "STAGED_TTL_MS",
    "STREAM_KEY",
    "UNKEEP_SCRIPT",
    "WRITE_SCRIPT",
]

STREAM_KEY = b"kvdock:v2:{invalidations}"
# a random id of the stream's incarnation, in its hash slot: an L3 that lost the stream (restarted
# empty, flushed) makes a new one, and every server that knew the old one sees a gap
INCARNATION_KEY = b"kvdock:v2:{invalidations}:incarnation"
MAXLEN = 100_000  # entries the stream keeps (approximately: XADD MAXLEN ~)
POLL_COUNT = 256  # entries one poll reads at most
FLOOR_TTL_MS = 60_000  # the default (--l3-floor-ttl-ms): the scripts take it as an argument
ISSUE_LIMIT_MS = 10_000
# an overwrite's floor lives at least this long whatever the TTL: a write issued before it (and
# refused once ISSUE_LIMIT_MS old) must find it (plus the masters' clocks' disagreement)
FLOOR_MIN_MS = ISSUE_LIMIT_MS + 5_000

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
# whether the value at ``key`` is a kvdock object whose header's msgpack body ends with ``tail``
# (objfile.mark: its version; packed(E2): an overwrite's version of that E2, its last field)
_ENDS = """
local function body_end(key)
  -- where the msgpack header of the kvdock object at ``key`` ends (objfile's prefix), nil for any other value
  local head = redis.call('GETRANGE', key, 0, 11)
  if string.len(head) < 12 or string.sub(head, 1, 8) ~= 'KVDOCKO1' then return nil end
  local a, b, c, d = string.byte(head, 9, 12)
  return 12 + a + b * 256 + c * 65536 + d * 16777216
end
local function ends(key, tail)
  local e = body_end(key)
  local n = string.len(tail)
  return e ~= nil and n > 0 and e - n >= 12 and redis.call('GETRANGE', key, e - n, e - 1) == tail
end
local function overwrite_of(key)
  -- the E2 an overwrite's version at ``key`` names (its header's last field), nil for any other
  local e = body_end(key)
  if not e then return nil end
  local tail = redis.call('GETRANGE', key, math.max(12, e - 40), e - 1)
  local s = string.match(tail, '(%d+%-%d+)$')
  if s and #s < 32 and string.byte(tail, #tail - #s) == 160 + #s then return s end
  return nil
end
local function packed(s)
  if #s < 32 then return string.char(160 + #s) .. s end
  if #s < 256 then return string.char(217, #s) .. s end
  return ''
end
"""
# the stream's incarnation (KEYS[2]); every entry names it too ('i'), so that one evicted alone
# (allkeys-lru: a small key) is restored from the stream's last entry, not taken for a lost stream
# (A-FLEET r9). A stream that is gone (evicted, deleted, flushed) starts a fresh incarnation
# (``fresh``) whose first entry (no keys) names it, at once: the stream exists for as long as its
# incarnation does, so that a missing one never passes for "no overwrite yet", and a write issued
# before the loss (under the old incarnation) is never committed (CHECK_SCRIPT). Not the same
# incarnation again: the new stream's first id is Redis' clock, which need not be past positions
# of the lost one (the same millisecond, a clock stepped back: A-STAGE r10 #1). The servers see
# the gap and drop L1 and L2; L3's objects of the old incarnation are orphaned (misses).
_INCARNATION = f"""
local function incarnation(key, fresh, stream)
  local inc = redis.call('GET', key)
  local live = redis.call('EXISTS', stream) == 1
  if inc and live then return inc end
  if live then
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    if last[1] then
      local f = last[1][2]
      for j = 1, #f - 1, 2 do
        if f[j] == 'i' then inc = f[j + 1] end
      end
    end
  end
  if (not live) or (not inc) then
    inc = fresh
    redis.call('XADD', stream, 'MAXLEN', '~', {MAXLEN}, '*', 'k', '\\144', 'i', inc)
  end
  redis.call('SET', key, inc)
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
local inc = incarnation(KEYS[2], ARGV[3], KEYS[1])
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
local inc = incarnation(KEYS[2], ARGV[2], KEYS[1])
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', {MAXLEN}, '*', 'k', ARGV[1], 'i', inc)
"""
)
# KEYS: value, floor, and (optional) the value's staged write and its nonce (STAGED_SUFFIX,
# NONCE_SUFFIX). ARGV: floor position, its TTL (ms). Raises the floor and deletes the value, unless
# the floor is already at a later position: then another overwrite's later entry came first and
# what the value holds was written past it (its version wins; a late step of an earlier overwrite
# must not delete it). A staged write goes either way: it is committed only if no overwrite's step
# ran after it landed. Returns the values deleted (0 or 1).
DELETE_SCRIPT = (
    _OLDER
    + """
if KEYS[3] then redis.call('DEL', KEYS[3], KEYS[4]) end
local f = redis.call('GET', KEYS[2])
if (not f) or older(f, ARGV[1]) ~= false then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]))
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)
# whether a plain version issued at ``pos`` would bring back what an overwrite replaced: below the
# floor; over the version of the overwrite that set the floor (a plain store that checked before
# that version landed: R-KEEP 1); with no floor (evicted), over an overwrite's version whose E2 is
# past ``pos`` (issued before that overwrite)
_STALE = """
local function stale(value, floor, pos)
  local f = redis.call('GET', floor)
  if f then return older(pos, f) ~= false or ends(value, packed(f)) end
  local o = overwrite_of(value)
  return o ~= nil and older(pos, o) ~= false
end
"""
STAGED_SUFFIX, NONCE_SUFFIX = b":s", b":n"
# every object's value expires this long after it was written (a cache: in practice never), so that
# under a volatile-* policy Redis evicts only objects, floors and staged writes, never the stream,
# its incarnation or the models' records, which carry no TTL (docs/scale-out.md)
OBJECT_TTL_MS = 30 * 86_400_000
STAGED_TTL_MS = 2 * ISSUE_LIMIT_MS  # a staged write nobody commits goes by itself
# KEYS: value, floor, and for a plain version the value's staged write and its nonce. ARGV:
# header, payload, position, issued (ms, L3's clock), the version's overwrite (its E2; "" for a
# plain store's), for a plain version its nonce. 1 written (staged), 0 refused as late, -1 as
# fenced. A plain version is refused if stale (above); it is written to the staged key with its
# nonce beside it (both expire after STAGED_TTL_MS), which readers never read: COMMIT_SCRIPT makes
# it the value once its server checked the stream (storage._redisstage). An overwrite's version
# is written only while its own floor is live (after its floor expired, or another overwrite
# raised it, its holders drop it: KEEP_SCRIPT). A server whose write is refused drops its copy
# (storage.keeping).
WRITE_SCRIPT = (
    _OLDER
    + _ENDS
    + _STALE
    + f"""
if now_ms() - tonumber(ARGV[4]) > {ISSUE_LIMIT_MS} then return 0 end
local into = KEYS[1]
if ARGV[5] ~= '' then
  if redis.call('GET', KEYS[2]) ~= ARGV[5] then return -1 end
elseif stale(KEYS[1], KEYS[2], ARGV[3]) then return -1
elseif KEYS[3] then
  into = KEYS[3]
  redis.call('SET', KEYS[4], ARGV[6], 'PX', {STAGED_TTL_MS})
end
redis.call('SET', into, ARGV[1])
redis.call('APPEND', into, ARGV[2])
local ttl = {OBJECT_TTL_MS}
if into ~= KEYS[1] then ttl = {STAGED_TTL_MS} end
redis.call('PEXPIRE', into, ttl)
return 1
"""
)
# KEYS: value, floor, staged, nonce. ARGV: the staged write's nonce, its position, '1' to commit it
# or '0' to drop it. Returns 1 committed (renamed onto the value, with OBJECT_TTL_MS), -1 dropped
# (asked to, or stale by now: an overwrite's floor came meanwhile), 0 not there any more (another
# server's write staged over it, an overwrite's step deleted it, or it expired or was evicted).
COMMIT_SCRIPT = (
    _OLDER
    + _ENDS
    + _STALE
    + f"""
if redis.call('GET', KEYS[4]) ~= ARGV[1] or redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if ARGV[3] == '1' and not stale(KEYS[1], KEYS[2], ARGV[2]) then
  redis.call('RENAME', KEYS[3], KEYS[1])
  redis.call('PEXPIRE', KEYS[1], {OBJECT_TTL_MS})
  redis.call('DEL', KEYS[4])
  return 1
end
redis.call('DEL', KEYS[3], KEYS[4])
return -1
"""
)
# KEYS: the stream, its incarnation. ARGV: an incarnation, a position, a count. The stream's
# entries after the position (at most count), or -1 where they cannot be told complete: another
# incarnation, a stream gone, trimmed past the position, or with an entry after it deleted (XDEL),
# or more than count of them. (A staged write is committed only if none of them names its key.)
CHECK_SCRIPT = (
    _OLDER
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local f = {}
for j = 1, #info, 2 do f[info[j]] = info[j + 1] end
local p = ARGV[2]
local md = f['max-deleted-entry-id']
if md and older(p, md) ~= false then return -1 end
if tonumber(f['length']) > 0 then
  if type(f['first-entry']) ~= 'table' or older(p, f['first-entry'][1]) ~= false then return -1 end
elseif older(p, f['last-generated-id']) ~= false then return -1 end
local n = tonumber(ARGV[3])
local e = redis.call('XRANGE', KEYS[1], '(' .. p, '+', 'COUNT', n + 1)
if #e > n then return -1 end
return e
"""
)
# KEYS: value, floor. ARGV: an overwrite's E2, the mark of the version held (objfile.mark: how its
# header's msgpack body ends), the floor's TTL (ms). A holder of that version may serve it on
# (storage.keeping) while this returns 1 (the floor is E2 and refreshed to at least the TTL, the
# value is that version; or the floor had expired and the value still is that version: set again)
# or 0 (the floor is E2 and refreshed, the value is gone: the holder writes it again); -1: drop
# it (another overwrite raised the floor, or the floor is gone or foreign, or the value is another
# version, which a plain store made past the floor).
KEEP_SCRIPT = (
    _ENDS
    + """
local function mine() return ends(KEYS[1], ARGV[2]) end
local f = redis.call('GET', KEYS[2])
if f then
  if f ~= ARGV[1] then return -1 end
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then  -- (never shortened: another holder's
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))      -- lease may count on a longer TTL)
  end
  if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
  if mine() then return 1 end
  return -1
end
if mine() then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[3]))
  return 1
end
return -1
"""
)
# KEYS: value, floor. ARGV: an overwrite's E2, the floor's TTL (ms). A holder that drops one shard
# of that overwrite's chunk (storage.keeping, F-SHARD2) unkeeps each of the chunk's shards: the
# value goes if it is that overwrite's version, and the floor, if it is E2 (or was gone and the value
# went), becomes E2 .. '!' (no position: KEEP and WRITE of E2's versions answer -1, plain writes are
# stale and plain stores wait while it lives, for at least FLOOR_MIN_MS; a later overwrite's step
# replaces it). Other overwrites' state and plain versions are left alone. Returns the values deleted.
UNKEEP_SCRIPT = (
    _ENDS
    + f"""
local f = redis.call('GET', KEYS[2])
local n = 0
if overwrite_of(KEYS[1]) == ARGV[1] then n = redis.call('DEL', KEYS[1]) end
if f == ARGV[1] or ((not f) and n == 1) then
  local ttl = math.max(redis.call('PTTL', KEYS[2]), tonumber(ARGV[2]), {FLOOR_MIN_MS})
  redis.call('SET', KEYS[2], ARGV[1] .. '!', 'PX', ttl)
end
return n
"""
)
# KEYS: value, floor. ARGV: an overwrite's E2. Whether a shard of a chunk is still whole with a
# sibling shard of that overwrite held elsewhere (storage.keeping; an overwrite of a sharded model
# covers every shard in one request: one E2): 1 if its floor is E2 and its value is that
# overwrite's version or gone (being written), or its floor is gone and its value is that
# overwrite's version; -1 otherwise (evicted, a plain version, another overwrite's). Reads only.
SHARD_SCRIPT = (
    _ENDS
    + """
local f = redis.call('GET', KEYS[2])
local o = overwrite_of(KEYS[1])
if f then
  if f == ARGV[1] and (o == ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0) then return 1 end
  return -1
end
if o == ARGV[1] then return 1 end
return -1
"""
)
