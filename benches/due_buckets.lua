-- A measuring prototype, not the product's script: the due queue's fetch and acknowledgement
-- (jobs/src/due_queue.lua's `fetch` and `batch`) over a shard whose cards are spread by card over
-- small buckets, each a sorted set (card -> score, as the due set's) and a hash (card -> poll
-- state) small enough to stay listpack-encoded, with a sorted set of the buckets by their head
-- (the earliest moment one of their entries is due or its lease ends). bench-lua
-- (benches/lua_cost.sh) runs it to tell what the layout costs Redis per poll against the due
-- queue's; bench-due-layouts writes the same records to tell what they cost in memory
-- (docs/BENCHMARKS.md).
--
-- benches/lua_cost.sh runs it after jobs/src/due_queue.lua's prologue (LEASED, now_ms, int).
--
-- KEYS[1] heads: bucket id -> its head (ms; a bucket with no entry has none)
-- KEYS[2] the shard's last lease score
-- KEYS[2 + 2i - 1], KEYS[2 + 2i]: bucket i's sorted set and hash, for each bucket the call names
--
-- fetch(max, lease_ms, id_1, id_2, ...): the buckets the caller read from heads as due (in
--   KEYS order, their heads' order); leases at most `max` of their due entries, each bucket's
--   earliest first, bucket by bucket. Returns card, lease, due ms, state for each, as
--   due_queue.lua's fetch does.
-- batch(n, i, card, lease, next_in_ms, state, ...): for each of n groups of five, as
--   due_queue.lua's `batch`, the card in the call's bucket i; then the call's buckets' ids.

local op = ARGV[1]
if op == 'fetch' then
  local max, lease_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
  local at = now_ms()
  local nb = #KEYS / 2 - 1
  -- The buckets in the order named (their heads' order): each gives its due entries, the
  -- earliest first, until `max` are taken; past them, each visited bucket's next entry of each
  -- kind is what becomes its head.
  local cand, rest, visited = {}, {}, 0
  for b = 1, nb do
    local want = max - #cand
    if want <= 0 then break end
    visited = b
    local z = KEYS[2 + 2 * b - 1]
    local w = redis.call('ZRANGE', z, '-inf', int(LEASED - 1), 'BYSCORE', 'LIMIT', '0', want + 1,
      'WITHSCORES')
    local e = redis.call('ZRANGE', z, int(LEASED), '+inf', 'BYSCORE', 'LIMIT', '0', want + 1,
      'WITHSCORES')
    local r, i, j, taken = {}, 1, 1, 0
    while taken < want do
      local ws = w[i + 1] and tonumber(w[i + 1])
      local es = e[j + 1] and tonumber(e[j + 1]) - LEASED
      if ws and ws > at then ws = nil end
      if es and es > at then es = nil end
      if not ws and not es then break end
      taken = taken + 1
      if ws and (not es or ws <= es) then
        cand[#cand + 1] = {ws, w[i], b}; i = i + 2
      else
        cand[#cand + 1] = {es, e[j], b}; j = j + 2
      end
    end
    if w[i + 1] and tonumber(w[i + 1]) then r[#r + 1] = tonumber(w[i + 1]) end
    if e[j + 1] then r[#r + 1] = tonumber(e[j + 1]) - LEASED end
    rest[b] = r
  end
  nb = visited
  local n = math.min(max, #cand)
  if n == 0 then return {} end
  local lease = math.max(LEASED + at + lease_ms, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  local lease_s = int(lease)
  redis.call('SET', KEYS[2], lease_s)
  local by = {}
  for k = 1, n do
    local c = cand[k]
    local t = by[c[3]]
    if not t then t = {}; by[c[3]] = t end
    t[#t + 1] = c[2]
  end
  local out, state_of, heads = {}, {}, {}
  for b, cards in pairs(by) do
    local z, h = KEYS[2 + 2 * b - 1], KEYS[2 + 2 * b]
    local args = {}
    for k = 1, #cards do args[2 * k - 1], args[2 * k] = lease_s, cards[k] end
    redis.call('ZADD', z, unpack(args))
    local st = redis.call('HMGET', h, unpack(cards))
    for k = 1, #cards do state_of[cards[k]] = st[k] or '' end
    rest[b][#rest[b] + 1] = lease - LEASED
  end
  for b = 1, nb do
    local head
    for _, s in ipairs(rest[b]) do
      if not head or s < head then head = s end
    end
    if head then heads[#heads + 1] = int(head); heads[#heads + 1] = ARGV[3 + b] end
  end
  if #heads > 0 then redis.call('ZADD', KEYS[1], unpack(heads)) end
  for k = 1, n do
    local c = cand[k]
    local o = 4 * k
    out[o - 3], out[o - 2], out[o - 1], out[o] = c[2], lease, c[1], state_of[c[2]]
  end
  return out
end

if op == 'batch' then
  local groups = {}
  local last = 2 + 5 * tonumber(ARGV[2])
  for i = 3, last, 5 do
    local b = tonumber(ARGV[i])
    local g = groups[b]
    if not g then g = {}; groups[b] = g end
    g[#g + 1] = i
  end
  local out, heads = {}, {}
  for b, g in pairs(groups) do
    local z, h = KEYS[2 + 2 * b - 1], KEYS[2 + 2 * b]
    local named = {}
    for _, i in ipairs(g) do
      local l = ARGV[i + 2]
      named[l] = named[l] or {}
      table.insert(named[l], ARGV[i + 1])
    end
    local held = {}
    for l, cards in pairs(named) do
      local cap = 3 * #cards + 1
      local holders = redis.call('ZRANGE', z, l, l, 'BYSCORE', 'LIMIT', '0', int(cap))
      for _, c in ipairs(holders) do held[c] = true end
    end
    local dues, states, head = {}, {}, nil
    for _, i in ipairs(g) do
      local card = ARGV[i + 1]
      if held[card] then
        held[card] = nil
        local due = now_ms() + tonumber(ARGV[i + 3])
        dues[#dues + 1] = int(due); dues[#dues + 1] = card
        states[#states + 1] = card; states[#states + 1] = ARGV[i + 4]
        if not head or due < head then head = due end
        out[(i - 3) / 5 + 1] = 1
      else
        out[(i - 3) / 5 + 1] = 0
      end
    end
    if #dues > 0 then
      redis.call('ZADD', z, unpack(dues))
      redis.call('HSET', h, unpack(states))
      heads[#heads + 1] = int(head); heads[#heads + 1] = ARGV[last + b]
    end
  end
  -- A successor only ever brings a bucket's head forward (LT); a head left early by an ended
  -- lease costs a later fetch one visit that finds nothing.
  if #heads > 0 then redis.call('ZADD', KEYS[1], 'LT', unpack(heads)) end
  return out
end

return redis.error_reply('due_buckets.lua: unknown op ' .. tostring(op))
