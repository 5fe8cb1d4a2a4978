"""The DLQ's Lua scripts on the fleet's Redis: each write of ``redisstore`` is one of them, so it
is atomic on the server (the record, its stream entry, its index and the counts change together
or not at all). Times are the server's clock (``TIME``), never a pod's.

Every script takes the DLQ's key prefix (``<key_prefix>dlq:``) as ARGV[1] and builds the names
it touches from it (see ``redisstore``'s docstring for the keys): the record's hash is KEYS[1].
Not for Redis Cluster (refused by the config: the keys of one write span slots).
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local P = ARGV[1]
local function stamp(x) return string.format('%.6f', x) end
"""

# KEYS[1]: the record; ARGV: prefix, group, id, route, max_records, max_bytes, size, a fresh
# epoch (set when none is), then field/value pairs of the record.
# -> {'ok', seq, epoch} | {'dup', epoch} | {'full', what, epoch}: the epoch in force
# (``redisepoch``)
ADD = (
    _NOW
    + """
local epoch = redis.call('GET', P .. 'meta:epoch')
if not epoch then
  epoch = ARGV[8]
  redis.call('SET', P .. 'meta:epoch', epoch)
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'dup', epoch} end
local counts = P .. 'meta:counts'
local held = tonumber(redis.call('HGET', counts, 'held_records') or '0')
local bytes = tonumber(redis.call('HGET', counts, 'held_bytes') or '0')
if held + 1 > tonumber(ARGV[5]) then return {'full', 'records', epoch} end
if bytes + tonumber(ARGV[7]) > tonumber(ARGV[6]) then return {'full', 'bytes', epoch} end
local seq = redis.call('INCR', P .. 'meta:seq')
local entry = redis.call('XADD', P .. ARGV[4], '*', 'id', ARGV[3])
redis.call('HSET', KEYS[1], 'seq', seq, 'entry', entry, 'status', 'pending',
  'updated_at', stamp(now), unpack(ARGV, 9))
redis.call('ZADD', P .. 'idx:' .. ARGV[4] .. ':pending', seq, ARGV[3])
redis.call('HINCRBY', counts, 'held_records', 1)
redis.call('HINCRBY', counts, 'held_bytes', ARGV[7])
redis.call('HINCRBY', counts, 'status:pending', 1)
redis.call('SADD', P .. 'meta:routes', ARGV[4])
return {'ok', tostring(seq), epoch}
"""
)

# KEYS[1]: the record; ARGV: prefix, owner, lease (seconds), statuses...
# -> {'ok', HGETALL} | {'missing'} | {'delivered'} | {'busy', holder, seconds left} | {'status', s}
CLAIM = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local r = redis.call('HMGET', KEYS[1], 'status', 'claimed_by', 'claim_expires_at')
local status, holder, expires = r[1], r[2] or '', tonumber(r[3] or '') or 0
if status == 'delivered' then return {'delivered'} end
if holder ~= '' and expires > now then return {'busy', holder, stamp(expires - now)} end
local wanted = false
for i = 4, #ARGV do if ARGV[i] == status then wanted = true end end
if not wanted then return {'status', status} end
if holder ~= '' then
  -- its holder died (the lease ran out): nobody knows how far that replay got
  redis.call('HSET', KEYS[1], 'reached_upstream', '1')
end
redis.call('HSET', KEYS[1], 'claimed_by', ARGV[2], 'claimed_at', stamp(now),
  'claim_expires_at', stamp(now + tonumber(ARGV[3])), 'finished_by', '', 'finished_as', '')
return {'ok', redis.call('HGETALL', KEYS[1])}
"""
)

# The record's stream entry acknowledged and deleted (it is no work for the redrive any more).
_DROP_ENTRY = """
local function drop_entry(route, entry, group)
  if entry ~= nil and entry ~= '' then
    redis.pcall('XACK', P .. route, group, entry)
    redis.call('XDEL', P .. route, entry)
  end
end
"""

# KEYS[1]: the record; ARGV: prefix, group, id, owner, status, count_replay, last_status,
# last_error, reached, parked_reason. -> 1 | 0 (the claim was not ours)
# A finish records who finished the claim and as what (``finished_by``, ``finished_as``; a
# claim clears both), so a finish sent again because its first reply was lost (a timeout, a
# connection cut: the first one ran) is recognised: the record unclaimed since, finished by
# this owner as this status, is 1 and changes nothing. Anyone else's claim or finish since
# (the lease ran out and another replay took it), or a purge, is 0 as before.
FINISH = (
    _NOW
    + _DROP_ENTRY
    + """
local r = redis.call('HMGET', KEYS[1], 'claimed_by', 'status', 'route', 'seq', 'size', 'entry',
  'finished_by', 'finished_as')
if r[1] == false or r[1] ~= ARGV[4] then
  if r[1] == '' and r[7] == ARGV[4] and r[8] == ARGV[5] then return 1 end
  return 0
end
local old, route, seq, size, entry = r[2], r[3], r[4], tonumber(r[5]), r[6]
local new = ARGV[5]
local reason = ''
if new == 'parked' then reason = ARGV[10] end
redis.call('HSET', KEYS[1], 'status', new, 'last_status', ARGV[7], 'last_error', ARGV[8],
  'updated_at', stamp(now), 'parked_reason', reason,
  'claimed_by', '', 'claimed_at', '', 'claim_expires_at', '',
  'finished_by', ARGV[4], 'finished_as', new)
redis.call('HINCRBY', KEYS[1], 'replays', tonumber(ARGV[6]))
if ARGV[9] == '1' then redis.call('HSET', KEYS[1], 'reached_upstream', '1') end
if old ~= new then
  local counts = P .. 'meta:counts'
  redis.call('ZREM', P .. 'idx:' .. route .. ':' .. old, ARGV[3])
  redis.call('ZADD', P .. 'idx:' .. route .. ':' .. new, seq, ARGV[3])
  redis.call('HINCRBY', counts, 'status:' .. old, -1)
  redis.call('HINCRBY', counts, 'status:' .. new, 1)
  if new == 'delivered' then
    redis.call('HINCRBY', counts, 'held_records', -1)
    redis.call('HINCRBY', counts, 'held_bytes', -size)
    redis.call('ZADD', P .. 'meta:delivered', now, ARGV[3])
  end
  if new == 'pending' then
    -- back to pending (a parked record replayed by hand that failed again): work anew
    local fresh = redis.call('XADD', P .. route, '*', 'id', ARGV[3])
    redis.call('HSET', KEYS[1], 'entry', fresh)
  elseif old == 'pending' then
    drop_entry(route, entry, ARGV[2])
    redis.call('HSET', KEYS[1], 'entry', '')
  end
end
return 1
"""
)

# KEYS[1]: the record; ARGV: prefix, owner, reached. -> 1 | 0
RELEASE = """
if redis.call('HGET', KEYS[1], 'claimed_by') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'claimed_by', '', 'claimed_at', '', 'claim_expires_at', '')
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'reached_upstream', '1') end
return 1
"""

# Deletes the record named by ``rid`` with everything that names it; counts updated.
_REMOVE = """
local function remove(key, rid, group)
  local r = redis.call('HMGET', key, 'status', 'route', 'size', 'entry')
  local status, route, size, entry = r[1], r[2], tonumber(r[3]), r[4]
  local counts = P .. 'meta:counts'
  redis.call('DEL', key)
  redis.call('ZREM', P .. 'idx:' .. route .. ':' .. status, rid)
  redis.call('ZREM', P .. 'meta:delivered', rid)
  redis.call('HINCRBY', counts, 'status:' .. status, -1)
  if status ~= 'delivered' then
    redis.call('HINCRBY', counts, 'held_records', -1)
    redis.call('HINCRBY', counts, 'held_bytes', -size)
  end
  drop_entry(route, entry, group)
end
"""

# KEYS[1]: the record; ARGV: prefix, group, id. -> 1 | 0 (none) | {'busy', holder}
DELETE = (
    _NOW
    + _DROP_ENTRY
    + _REMOVE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local r = redis.call('HMGET', KEYS[1], 'claimed_by', 'claim_expires_at')
if (r[1] or '') ~= '' and (tonumber(r[2] or '') or 0) > now then return {'busy', r[1]} end
remove(KEYS[1], ARGV[3], ARGV[2])
return 1
"""
)

# ARGV: prefix, group, age (seconds), batch. -> how many were deleted: records delivered more
# than ``age`` ago on Redis's clock (as their delivery was stamped), whatever the pod's clock
# says. Any sidecar may run it at any time: a record deleted already is skipped.
PRUNE = (
    _NOW
    + _DROP_ENTRY
    + _REMOVE
    + """
local ids = redis.call('ZRANGEBYSCORE', P .. 'meta:delivered', '-inf',
  '(' .. stamp(now - tonumber(ARGV[3])),
  'LIMIT', 0, tonumber(ARGV[4]))
local n = 0
for _, rid in ipairs(ids) do
  local key = P .. 'rec:' .. rid
  if redis.call('HGET', key, 'status') == 'delivered' then
    remove(key, rid, ARGV[2])
    n = n + 1
  else
    redis.call('ZREM', P .. 'meta:delivered', rid)
  end
end
return n
"""
)
