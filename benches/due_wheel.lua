-- A measuring prototype, not the product's script: the due queue's fetch and acknowledgement
-- (jobs/src/due_queue.lua's `fetch` and `batch`) over a timing wheel. Each time slot is a list of
-- the entries due in it, each entry one string `due|card|state` (the due time in ms as 13
-- decimal digits, so that strings compare as times), kept in due order; a sorted set names the
-- slots that hold any. A leased entry moves to one in-flight sorted set, the entry itself its
-- member and the lease its score: an ended lease hands the entry, state and all, to the next
-- fetch. No record is kept per card besides its entry, and none is read or written per card by
-- lookup: the lists are touched at their ends, and an acknowledgement reads a lease's holders as
-- a score range (Redis formats no score for it). bench-lua (benches/lua_cost.sh) runs it against
-- the due queue's script (docs/BENCHMARKS.md).
--
-- What the prototype leaves out, as the product would need it: a successor due before its slot's
-- last entry (a shorter delay than its neighbours': inserted in order), the cards' presence (for
-- adding a card once, and for merge, restart and remove, which find a waiting card's entry), the
-- wait until the next due entry, and the release, finish and extend ops.
--
-- benches/lua_cost.sh runs it after jobs/src/due_queue.lua's prologue (LEASED, now_ms, int).
--
-- KEYS[1] slots: slot id -> slot id (a slot's id is its start in ms / its width)
-- KEYS[2] the shard's last lease score
-- KEYS[3] in flight: entry -> lease score (as the due set's: LEASED + deadline)
-- KEYS[4..] the slot lists the call names, in the order of the ids after the op's arguments
--
-- fetch(max, lease_ms, id...): the slots the caller read as due (their ids, in order); leases at
--   most `max` due entries, the ended leases' first, then the slots' from their heads. Returns
--   the lease, then the entries.
-- batch(n, i, entry, card, lease, next_in_ms, state, ...): for each of n groups of six, as
--   due_queue.lua's `batch`: the poll of `entry` under `lease` is over, and its card's successor
--   goes to the call's slot list i (the slot the caller worked out for its due time); then the
--   slots' ids.

local op = ARGV[1]
if op == 'fetch' then
  local max, lease_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
  local at = now_ms()
  local at_s = string.format('%013d', at)
  local entries = redis.call('ZRANGE', KEYS[3], int(LEASED), int(LEASED + at), 'BYSCORE', 'LIMIT',
    '0', max)
  for s = 4, #KEYS do
    local want = max - #entries
    if want <= 0 then break end
    local list = redis.call('LRANGE', KEYS[s], '0', want - 1)
    local n = 0
    for k = 1, #list do
      local e = list[k]
      if string.sub(e, 1, 13) > at_s then break end
      n = k
      entries[#entries + 1] = e
    end
    if n > 0 then
      redis.call('LTRIM', KEYS[s], n, -1)
      if n == #list and redis.call('EXISTS', KEYS[s]) == 0 then
        redis.call('ZREM', KEYS[1], ARGV[s])
      end
    end
    if n < #list then break end
  end
  if #entries == 0 then return {} end
  local lease = math.max(LEASED + at + lease_ms, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  local lease_s = int(lease)
  redis.call('SET', KEYS[2], lease_s)
  local z = {}
  for k = 1, #entries do z[2 * k - 1], z[2 * k] = lease_s, entries[k] end
  redis.call('ZADD', KEYS[3], unpack(z))
  local out = {lease}
  for k = 1, #entries do out[k + 1] = entries[k] end
  return out
end

if op == 'batch' then
  local n = tonumber(ARGV[2])
  local last = 2 + 6 * n
  -- The entries each named lease holds, read once per lease as a score range.
  local held = {}
  for k = 1, n do
    local lease = ARGV[6 + 6 * (k - 1)]
    if not held[lease] then
      local h = {}
      for _, c in ipairs(redis.call('ZRANGE', KEYS[3], lease, lease, 'BYSCORE')) do h[c] = true end
      held[lease] = h
    end
  end
  local gone, by_slot, out, due_in = {}, {}, {}, {}
  for k = 1, n do
    local i = 3 + 6 * (k - 1)
    local h = held[ARGV[i + 3]]
    if h[ARGV[i + 1]] then
      h[ARGV[i + 1]] = nil
      gone[#gone + 1] = ARGV[i + 1]
      local s = tonumber(ARGV[i])
      local list = by_slot[s]
      if not list then list = {}; by_slot[s] = list end
      -- The successor's due time is formatted once per distinct delay.
      local a = ARGV[i + 4]
      local due = due_in[a]
      if not due then
        due = string.format('%013d|', now_ms() + tonumber(a))
        due_in[a] = due
      end
      list[#list + 1] = due .. ARGV[i + 2] .. '|' .. ARGV[i + 5]
      out[k] = 1
    else
      out[k] = 0
    end
  end
  if #gone > 0 then redis.call('ZREM', KEYS[3], unpack(gone)) end
  local slots = {}
  for s, list in pairs(by_slot) do
    redis.call('RPUSH', KEYS[3 + s], unpack(list))
    slots[#slots + 1] = ARGV[last + s]
    slots[#slots + 1] = ARGV[last + s]
  end
  if #slots > 0 then redis.call('ZADD', KEYS[1], 'NX', unpack(slots)) end
  return out
end

return redis.error_reply('due_wheel.lua: unknown op ' .. tostring(op))
