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
-- KEYS[3] in flight: lease score -> its deadline (ms)
-- KEYS[4] in flight: lease score -> `card|entry\n` for each entry it holds
-- KEYS[5..] the slot lists the call names, in the order of the ids after the op's arguments
--
-- fetch(max, lease_ms, id...): the slots the caller read as due (their ids, in order); leases at
--   most `max` due entries, an ended lease's first, then the slots' due entries from their
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
  local ended = redis.call('ZRANGE', KEYS[3], '-inf', int(at), 'BYSCORE', 'LIMIT', '0', '1')
  if ended[1] then
    local held = redis.call('HGET', KEYS[4], ended[1]) or ''
    for line in string.gmatch(held, '[^\n]+') do
      local bar = string.find(line, '|', 1, true)
      cards[#cards + 1] = string.sub(line, 1, bar - 1)
      entries[#entries + 1] = string.sub(line, bar + 1)
    end
    redis.call('ZREM', KEYS[3], ended[1])
    redis.call('HDEL', KEYS[4], ended[1])
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
  redis.call('ZADD', KEYS[3], int(lease - LEASED), lease_s)
  local lines = {}
  for k = 1, #cards do lines[k] = cards[k] .. '|' .. entries[k] .. '\n' end
  redis.call('HSET', KEYS[4], lease_s, table.concat(lines))
  local out = {}
  for k = 1, #cards do
    out[3 * k - 2], out[3 * k - 1], out[3 * k] = cards[k], lease, entries[k]
  end
  return out
end

if op == 'batch' then
  local n = tonumber(ARGV[2])
  local last = 2 + 5 * n
  -- Each named lease's group is read once; a card it holds is cut out of it (its line), and
  -- what is left is written back once, or the group goes when it is empty.
  local groups, order, out, by_slot = {}, {}, {}, {}
  for k = 1, n do
    local i = 3 + 5 * (k - 1)
    local lease = ARGV[i + 2]
    local g = groups[lease]
    if g == nil then
      g = redis.call('HGET', KEYS[4], lease) or false
      groups[lease] = g
      order[#order + 1] = lease
    end
    local card = ARGV[i + 1]
    local whole = g and '\n' .. g
    local from = whole and string.find(whole, '\n' .. card .. '|', 1, true)
    if from then
      local to = string.find(whole, '\n', from + 1, true)
      groups[lease] = string.sub(whole, 2, from) .. string.sub(whole, to + 1)
      local s = tonumber(ARGV[i])
      local list = by_slot[s]
      if not list then list = {}; by_slot[s] = list end
      list[#list + 1] = string.format('%013d', now_ms() + tonumber(ARGV[i + 3])) .. '|' ..
        card .. '|' .. ARGV[i + 4]
      out[k] = 1
    else
      out[k] = 0
    end
  end
  for _, lease in ipairs(order) do
    local g = groups[lease]
    if g then
      if g == '' then
        redis.call('HDEL', KEYS[4], lease)
        redis.call('ZREM', KEYS[3], lease)
      else
        redis.call('HSET', KEYS[4], lease, g)
      end
    end
  end
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
