-- The due queue of one polling task shard: one sorted set, one record per card. Every key a
-- call touches is in KEYS and carries the shard's hash tag, so the script runs on a Redis Cluster.
--
-- KEYS[1] the due set: card_ref -> score. A waiting entry's score is its due time (unix ms,
--         Redis clock), below LEASED; a leased entry's is LEASED + its lease's deadline.
-- KEYS[2] the shard's last lease score (a string).
-- ARGV[1] the op; the rest per op, below.
--
-- A lease is named by its score, and no two leases of a card ever share one: every lease score
-- the shard writes (a fetch's, an extension's) is above the last one it wrote (KEYS[2]), so a
-- card's later lease always scores above its earlier ones, even when the card was acknowledged
-- and fetched again within one millisecond. Every op that names a lease acts only while that
-- lease holds the card, so a stale or repeated acknowledgement, release or extension changes
-- nothing, and a fetch takes only a card that waits and is due, or whose lease has ended: one
-- lease holds a card at a time.
local LEASED = 1125899906842624 -- 2^50 ms (about 35,000 years): above every due time

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The score of a lease written now that must end no earlier than `at`: above the shard's last.
local function next_lease(at)
  local lease = math.max(at, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  redis.call('SET', KEYS[2], lease)
  return lease
end

-- Whether `lease` (a score, as its caller was given it) holds `card` now.
local function holds(card, lease)
  local s = redis.call('ZSCORE', KEYS[1], card)
  return s and tonumber(s) == tonumber(lease)
end

-- Numbers go back as numbers (integer replies, exact), never through tostring(), whose 14
-- significant digits would round a lease score.
local op = ARGV[1]

-- fetch(max, lease_ms): leases at most `max` due entries, the earliest due first, each until
-- now + lease_ms. An entry whose lease ended is due again, as of its lease's deadline. Returns a
-- flat array: card_ref, lease (its score), due ms, for each entry taken.
if op == 'fetch' then
  local max = tonumber(ARGV[2])
  local lease_ms = tonumber(ARGV[3])
  local now = now_ms()
  local waiting = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, max, 'WITHSCORES')
  local ended = redis.call('ZRANGE', KEYS[1], LEASED, LEASED + now, 'BYSCORE', 'LIMIT', 0, max,
    'WITHSCORES')
  if #waiting == 0 and #ended == 0 then return {} end
  local lease = next_lease(LEASED + now + lease_ms)
  local out = {}
  local i, j, taken = 1, 1, 0
  while taken < max and (i <= #waiting or j <= #ended) do
    local card, due
    local w = waiting[i + 1] and tonumber(waiting[i + 1])
    local e = ended[j + 1] and (tonumber(ended[j + 1]) - LEASED)
    if w and (not e or w <= e) then
      card, due = waiting[i], w
      i = i + 2
    else
      card, due = ended[j], e
      j = j + 2
    end
    redis.call('ZADD', KEYS[1], lease, card)
    out[#out + 1] = card
    out[#out + 1] = lease
    out[#out + 1] = due
    taken = taken + 1
  end
  return out
end

-- ack(card, lease, next_in_ms, ...): for each triple, the poll under `lease` is over and its
-- card is due again next_in_ms from now (the successor). Returns one number a triple: 1, or 0
-- when `lease` no longer holds the card (it ended and the card was leased again, or it was
-- acknowledged already), and nothing changed for it.
if op == 'ack' then
  local now = now_ms()
  local out = {}
  for i = 2, #ARGV, 3 do
    local card = ARGV[i]
    if holds(card, ARGV[i + 1]) then
      redis.call('ZADD', KEYS[1], now + tonumber(ARGV[i + 2]), card)
      out[#out + 1] = 1
    else
      out[#out + 1] = 0
    end
  end
  return out
end

-- release(card, lease, due): gives the card back unpolled (no token was free), at the due time
-- it was fetched with, so it keeps its place among the due entries. Returns 1, or 0 as ack.
if op == 'release' then
  local card = ARGV[2]
  if not holds(card, ARGV[3]) then return 0 end
  redis.call('ZADD', KEYS[1], tonumber(ARGV[4]), card)
  return 1
end

-- extend(card, lease, lease_ms): the poll under `lease` runs on; its lease ends lease_ms from
-- now (or a little later), unless it ends later already. Returns the lease's score from now on
-- (the name its holder uses), or 0 when `lease` no longer holds the card.
if op == 'extend' then
  local card = ARGV[2]
  local held = tonumber(ARGV[3])
  if not holds(card, held) then return 0 end
  local want = LEASED + now_ms() + tonumber(ARGV[4])
  if want <= held then return held end
  local lease = next_lease(want)
  redis.call('ZADD', KEYS[1], lease, card)
  return lease
end

-- add(card, in_ms): the card's first poll is due in_ms from now, unless the card has an entry
-- already (waiting or leased), which is left as it is. Returns 1 when added.
if op == 'add' then
  return redis.call('ZADD', KEYS[1], 'NX', now_ms() + tonumber(ARGV[3]), ARGV[2])
end

-- remove(card): the card is polled no more. A running poll's acknowledgement then changes
-- nothing. Returns 1 when the card had an entry.
if op == 'remove' then
  return redis.call('ZREM', KEYS[1], ARGV[2])
end

-- head(): what the lateness gauges read: {now, the earliest due ms of an entry that waits or
-- whose lease ended (-1 when none), how many are due now}.
if op == 'head' then
  local now = now_ms()
  local first = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  local ended = redis.call('ZRANGE', KEYS[1], LEASED, LEASED + now, 'BYSCORE', 'LIMIT', 0, 1,
    'WITHSCORES')
  local earliest = first[2] and tonumber(first[2])
  if ended[2] then
    local e = tonumber(ended[2]) - LEASED
    if not earliest or e < earliest then earliest = e end
  end
  local due = redis.call('ZCOUNT', KEYS[1], '-inf', now)
    + redis.call('ZCOUNT', KEYS[1], LEASED, LEASED + now)
  return {now, earliest or -1, due}
end

return redis.error_reply('due_queue.lua: unknown op ' .. tostring(op))
