-- A measuring prototype, not the product's script: the due queue's fetch and acknowledgement
-- (jobs/src/due_queue.lua's `fetch` and `batch`) over a timing wheel. Each time slot is a list of
-- the entries due in it, each entry one string `due|card|state` (the due time in ms as 13
-- decimal digits, so that strings compare as times), kept in due order; a sorted set names the
-- slots that hold any. A leased entry moves to an in-flight sorted set (card -> lease score) and
-- hash (card -> its entry). No record is kept per card besides its entry, so no call reads or
-- writes one per card: the lists are only touched at their ends. bench-lua
-- (benches/lua_cost.sh) runs it against the due queue's script (docs/BENCHMARKS.md).
--
-- KEYS[1] slots: slot id -> slot id (a slot's id is its start in ms ÷ its width)
-- KEYS[2] the shard's last lease score
-- KEYS[3] in flight: card -> lease score (as the due set's: LEASED + deadline)
-- KEYS[4] in flight: card -> its entry
-- KEYS[5..] the slot lists the call names, in the order of the ids after the op's arguments
--
-- fetch(max, lease_ms, id...): the slots the caller read as due (their ids, in order); leases at
--   most `max` due entries, the ended leases first, then the slots' due entries from their
--   heads. Returns card, lease, entry for each.
-- batch(n, i, card, lease, next_in_ms, state, ...): for each of n groups of five, as
--   due_queue.lua's `batch`: the card's successor goes to the call's slot list i (the slot the
--   caller worked out for its due time); then the slots' ids.
local LEASED = 1125899906842624
local now
local function now_ms()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end
local function int(n) return string.format('%d', n) end

local op = ARGV[1]
if op == 'fetch' then
  local max, lease_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
  local at = now_ms()
  local at_s = string.format('%013d', at)
  local cards, entries = {}, {}
  local ended = redis.call('ZRANGE', KEYS[3], int(LEASED), int(LEASED + at), 'BYSCORE', 'LIMIT',
    '0', max)
  if #ended > 0 then
    local e = redis.call('HMGET', KEYS[4], unpack(ended))
    for k = 1, #ended do cards[k], entries[k] = ended[k], e[k] end
  end
  for s = 5, #KEYS do
    local want = max - #cards
    if want <= 0 then break end
    local list = redis.call('LRANGE', KEYS[s], '0', want - 1)
    local n = 0
    for k = 1, #list do
      local e = list[k]
      if string.sub(e, 1, 13) > at_s then break end
      n = k
      cards[#cards + 1] = string.sub(e, 15, string.find(e, '|', 15, true) - 1)
      entries[#entries + 1] = e
    end
    if n > 0 then
      redis.call('LTRIM', KEYS[s], n, -1)
      if n == #list and redis.call('EXISTS', KEYS[s]) == 0 then
        redis.call('ZREM', KEYS[1], ARGV[3 + s - 4])
      end
    end
    if n < #list then break end
  end
  if #cards == 0 then return {} end
  local lease = math.max(LEASED + at + lease_ms, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  local lease_s = int(lease)
  redis.call('SET', KEYS[2], lease_s)
  local z, h, out = {}, {}, {}
  for k = 1, #cards do
    z[2 * k - 1], z[2 * k] = lease_s, cards[k]
    h[2 * k - 1], h[2 * k] = cards[k], entries[k]
    out[3 * k - 2], out[3 * k - 1], out[3 * k] = cards[k], lease, entries[k]
  end
  redis.call('ZADD', KEYS[3], unpack(z))
  redis.call('HSET', KEYS[4], unpack(h))
  return out
end

if op == 'batch' then
  local n = tonumber(ARGV[2])
  local last = 2 + 5 * n
  local named = {}
  for k = 1, n do named[k] = ARGV[4 + 5 * (k - 1)] end
  local scores = redis.call('ZMSCORE', KEYS[3], unpack(named))
  local gone, by_slot, out = {}, {}, {}
  for k = 1, n do
    local i = 3 + 5 * (k - 1)
    if scores[k] and scores[k] == ARGV[i + 2] then
      gone[#gone + 1] = ARGV[i + 1]
      local s = tonumber(ARGV[i])
      local list = by_slot[s]
      if not list then list = {}; by_slot[s] = list end
      list[#list + 1] = string.format('%013d', now_ms() + tonumber(ARGV[i + 3])) .. '|' ..
        ARGV[i + 1] .. '|' .. ARGV[i + 4]
      out[k] = 1
    else
      out[k] = 0
    end
  end
  if #gone > 0 then
    redis.call('ZREM', KEYS[3], unpack(gone))
    redis.call('HDEL', KEYS[4], unpack(gone))
  end
  -- A successor is due no earlier than the list's last entry in the common case (one interval
  -- per task), so it is appended; the prototype measures that case only.
  local slots = {}
  for s, list in pairs(by_slot) do
    redis.call('RPUSH', KEYS[4 + s], unpack(list))
    slots[#slots + 1] = ARGV[last + s]
    slots[#slots + 1] = ARGV[last + s]
  end
  if #slots > 0 then redis.call('ZADD', KEYS[1], 'NX', unpack(slots)) end
  return out
end

return redis.error_reply('due_wheel.lua: unknown op ' .. tostring(op))
