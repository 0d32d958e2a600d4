-- The due queue of one polling task shard: one sorted set and one hash, one record per card in
-- each. Every key a call touches is in KEYS and carries the shard's hash tag, so the script runs
-- on a Redis Cluster.
--
-- KEYS[1] the due set: card_ref -> score. A waiting entry's score is its due time (unix ms,
--         Redis clock), below LEASED; a leased entry's is LEASED + its lease's deadline.
-- KEYS[2] the shard's last lease score (a string).
-- KEYS[3] the poll state: card_ref -> `unchanged|last|since|state`, what the card's next poll
--         needs and what `investigate` shows (the chain entry's fields without its id):
--         `unchanged` polls counted since `since`, the `last` one (base-36 unix seconds, '0' for
--         none), `since` as a kind letter ('c' the last recorded change or failure, 's' the
--         card's first poll here: nothing before it is known) plus base-36 unix seconds; then
--         the next poll's `failures`, or `failures.deferrals` once the budget deferred it.
--         Written with the due entry, removed with it: a card has both or neither.
-- ARGV[1] the op; the rest per op, below.
--
-- A lease is named by its score, and no two leases of a card ever share one: every lease score
-- the shard writes (a fetch's, an extension's) is above the last one it wrote (KEYS[2]), so a
-- card's later lease always scores above its earlier ones, even when the card was acknowledged
-- and fetched again within one millisecond. Every op that names a lease acts only while that
-- lease holds the card, so a stale or repeated acknowledgement, release, extension or finish
-- changes nothing, and a fetch takes only a card that waits and is due, or whose lease has ended:
-- one lease holds a card at a time.
local LEASED = 1125899906842624 -- 2^50 ms (about 35,000 years): above every due time
-- An acknowledgement reads a lease's holders as a score range while they are at most this many
-- times the cards named with it, else the named cards' scores (see ack): a holder costs Redis
-- less to read than a score, which it formats, but a range may hold cards nobody named.
local RANGE_READ_MAX = 3

local now, now_b36
local function now_ms()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- `n` (a whole number) as the decimal string Redis reads: a Lua number handed to redis.call is
-- formatted with "%.17g", several times the cost of this; the hot ops pass their numbers so.
local function int(n)
  return string.format('%d', n)
end

local DIGITS = '0123456789abcdefghijklmnopqrstuvwxyz'
-- The Redis clock's whole seconds in base 36 (the state's times).
local function stamp()
  if not now_b36 then
    local n = math.floor(now_ms() / 1000)
    local s = ''
    while n > 0 do
      local d = n % 36
      s = string.sub(DIGITS, d + 1, d + 1) .. s
      n = math.floor(n / 36)
    end
    now_b36 = s
  end
  return now_b36
end

-- The state of a card polled here for the first time (or whose state is unreadable).
local function fresh()
  return '0|0|s' .. stamp() .. '|0'
end

-- The score of a lease written now that must end no earlier than `at`: above the shard's last.
local function next_lease(at)
  local lease = math.max(at, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  redis.call('SET', KEYS[2], int(lease))
  return lease
end

-- Whether `lease` (a score, as its caller was given it) holds `card` now.
local function holds(card, lease)
  local s = redis.call('ZSCORE', KEYS[1], card)
  return s and tonumber(s) == tonumber(lease)
end

-- Adds `card` due at `due` ms with `state` ('' a fresh one), unless it has an entry already
-- (waiting or leased), which is left as it is: a card has both records or neither. Returns 1 when
-- added, else 0.
local function add_new(card, due, state)
  if redis.call('ZADD', KEYS[1], 'NX', int(due), card) == 0 then return 0 end
  if state == '' then state = fresh() end
  redis.call('HSET', KEYS[3], card, state)
  return 1
end

-- Runs `cmd key args...` over a flat list of arguments, in as few calls as Lua's stack allows
-- (unpack takes some thousands of values): one call for any batch a worker sends. Returns the
-- reply (for HMGET and ZMSCORE, its elements, concatenated over the calls when there were
-- several).
local CHUNK = 1000
local function call_many(cmd, key, args, width)
  local step = CHUNK * width
  if #args == 0 then return {} end
  if #args <= step then return redis.call(cmd, key, unpack(args)) end
  local out = {}
  for first = 1, #args, step do
    local r = redis.call(cmd, key, unpack(args, first, math.min(first + step - 1, #args)))
    if type(r) == 'table' then
      for k = 1, #r do out[#out + 1] = r[k] end
    end
  end
  return out
end

-- A table of `n` array slots (their values are placeholders to overwrite), allocated once:
-- filling an empty table one slot at a time makes Lua grow it at every power of two, which
-- costs a poll's script more than its own work. `like` is any table of at least `n` values.
local function sized(like, n)
  if n == 0 then return {} end
  if n > 2 * CHUNK then
    local t = {}
    for k = 1, n do t[k] = false end
    return t
  end
  return {unpack(like, 1, n)}
end

-- Writes the due entries (`due, card` pairs) and the states (`card, state` pairs) of the same
-- cards: a card has both records or neither.
local function write_records(dues, states)
  call_many('ZADD', KEYS[1], dues, 2)
  call_many('HSET', KEYS[3], states, 2)
end

-- add_new for every group of `width` arguments from ARGV[2], each a card (ARGV[i]) and what
-- follows it: it is due at due(i) with state(i). One ZMSCORE finds the cards that have an entry,
-- then one ZADD and one HSET add the others: a reconcile pass's batch costs Redis the same few
-- commands whatever its size. A card named twice is added once, as first named. Returns how many
-- were added.
local function add_all(width, due, state)
  local cards = {}
  for i = 2, #ARGV, width do cards[#cards + 1] = ARGV[i] end
  local scores = call_many('ZMSCORE', KEYS[1], cards, 1)
  local dues, states, seen, added = {}, {}, {}, 0
  for k = 1, #cards do
    local card = cards[k]
    if not scores[k] and not seen[card] then
      seen[card] = true
      local i = 2 + (k - 1) * width
      local s = state(i)
      if s == '' then s = fresh() end
      added = added + 1
      dues[2 * added - 1], dues[2 * added] = int(due(i)), card
      states[2 * added - 1], states[2 * added] = card, s
    end
  end
  write_records(dues, states)
  return added
end

-- Numbers go back as numbers (integer replies, exact), never through tostring(), whose 14
-- significant digits would round a lease score.
local op = ARGV[1]

-- fetch(max, lease_ms): leases at most `max` due entries, the earliest due first, each until
-- now + lease_ms. An entry whose lease ended is due again, as of its lease's deadline. Returns
-- {lease (its score), {card_ref, due ms, ...}, {state, ...}} for the entries taken, in order: a
-- waiting card's due ms as ZRANGE wrote its score (whole-number digits, so that no number is
-- converted twice), a state false (nil) when the card has none. When none is due, {ms until the
-- next one is} ({} for an empty shard), so that an idle worker sleeps until then. The replies of
-- the script's own reads go back as they came, in nested arrays, so that no table is built per
-- card for the answer.
if op == 'fetch' then
  local max = tonumber(ARGV[2])
  local lease_ms = tonumber(ARGV[3])
  local at = now_ms()
  -- The set's first entry is its earliest waiting card, or, when none waits, its earliest lease.
  -- An idle shard answers from it and the earliest lease alone (two reads): the worker sleeps
  -- until the sooner of the two.
  local first = redis.call('ZRANGE', KEYS[1], '0', '0', 'WITHSCORES')
  if not first[2] then return {} end
  local first_at = tonumber(first[2])
  if first_at >= LEASED then
    if first_at - LEASED > at then return {first_at - LEASED - at} end
  elseif first_at > at then
    local held = redis.call('ZRANGE', KEYS[1], int(LEASED), '+inf', 'BYSCORE', 'LIMIT', '0', '1',
      'WITHSCORES')
    local next_at = first_at
    if held[2] then next_at = math.min(next_at, tonumber(held[2]) - LEASED) end
    if next_at > at then return {next_at - at} end
  end
  local taken = redis.call('ZRANGE', KEYS[1], '-inf', int(at), 'BYSCORE', 'LIMIT', '0', ARGV[2],
    'WITHSCORES')
  local ended = redis.call('ZRANGE', KEYS[1], int(LEASED), int(LEASED + at), 'BYSCORE', 'LIMIT',
    '0', ARGV[2], 'WITHSCORES')
  if #taken == 0 and #ended == 0 then return {0} end
  if #ended > 0 then
    -- Both kinds are due: the earliest `max` of the two, each ended lease due as of its deadline.
    local waiting = taken
    taken = {}
    local i, j = 1, 1
    while #taken < 2 * max and (i <= #waiting or j <= #ended) do
      local e = ended[j + 1] and (tonumber(ended[j + 1]) - LEASED)
      if waiting[i] and (not e or tonumber(waiting[i + 1]) <= e) then
        taken[#taken + 1], taken[#taken + 2] = waiting[i], waiting[i + 1]
        i = i + 2
      else
        taken[#taken + 1], taken[#taken + 2] = ended[j], int(e)
        j = j + 2
      end
    end
  end
  local lease = next_lease(LEASED + at + lease_ms)
  local lease_s = int(lease)
  -- One ZADD leasing them all and one HMGET of their states: a fetch costs Redis the same few
  -- commands whatever its size.
  local n = #taken / 2
  local leases, cards = sized(taken, 2 * n), sized(taken, n)
  for k = 1, n do
    local card = taken[2 * k - 1]
    leases[2 * k - 1], leases[2 * k], cards[k] = lease_s, card, card
  end
  call_many('ZADD', KEYS[1], leases, 2)
  return {lease, taken, call_many('HMGET', KEYS[3], cards, 1)}
end

-- ack(card, lease, next_in_ms, state, ...): for each group of four, the poll under `lease` is
-- over, its card is due again next_in_ms from now (the successor) with `state` (the worker works
-- it out from the state the fetch handed it: the lease fences the write, so no other write of the
-- card's state came between). Returns one number a group: 1, or 0 when `lease` no longer holds
-- the card (it ended and the card was leased again, it was acknowledged already, or the card was
-- removed), and nothing changed for it. `batch` is the same op under the name a process's batched
-- calls send (`queue::batch`).
if op == 'ack' or op == 'batch' then
  -- Which named cards each named lease holds is read once per distinct lease (a fetch's cards
  -- share one), then one ZADD and one HSET write every held card's successor: an
  -- acknowledgement costs Redis the same few commands whatever its size. A lease is read as a
  -- score range (ZRANGE of its holders, at most RANGE_READ_MAX per card named with it, plus
  -- one): Redis formats every score it replies with ("%.17g"), the costliest part of a per-card
  -- check, and a range replies with none. A lease that holds more (a big fetch whose polls end
  -- one by one) has the named cards' scores read instead (ZMSCORE), so that a call never reads a
  -- lease's whole fetch for one card. A card named twice is acknowledged once: its first
  -- successor ends the lease the second names.
  local m = (#ARGV - 1) / 4
  -- named[lease] = how many cards name it; first[lease] = where the first of them is in ARGV.
  local named, first, leases = {}, {}, {}
  for i = 3, #ARGV, 4 do
    local lease = ARGV[i]
    local c = named[lease]
    if not c then
      c = 0
      first[lease] = i - 1
      leases[#leases + 1] = lease
    end
    named[lease] = c + 1
  end
  -- held[card] = the named lease that holds it.
  local held = {}
  for _, lease in ipairs(leases) do
    -- A lease that is not a whole number holds nothing (a range would fail the call on it).
    if string.match(lease, '^%d+$') then
      -- One more than the holders a range may have: a full answer means the lease holds more. A
      -- lone card's own score is read at once: one read either way.
      local cap = RANGE_READ_MAX * named[lease] + 1
      local holders
      if named[lease] > 1 then
        holders = redis.call('ZRANGE', KEYS[1], lease, lease, 'BYSCORE', 'LIMIT', '0', int(cap))
        if #holders == cap then holders = nil end
      end
      if holders then
        for _, c in ipairs(holders) do held[c] = lease end
      else
        -- The cards named with it, found from its first: a batch of lone cards, each under a
        -- lease of its own (polls that end one by one), reads ARGV once, not once per lease.
        local cards = {ARGV[first[lease]]}
        if named[lease] > 1 then
          for i = first[lease] + 4, #ARGV, 4 do
            if ARGV[i + 1] == lease then cards[#cards + 1] = ARGV[i] end
          end
        end
        local want = tonumber(lease)
        local scores = call_many('ZMSCORE', KEYS[1], cards, 1)
        for j = 1, #cards do
          if scores[j] and tonumber(scores[j]) == want then held[cards[j]] = lease end
        end
      end
    end
  end
  -- The answer and the successors' records, in tables allocated once at their largest (every
  -- card held); the records' unused tail is cleared before they are written.
  local out, dues, states = sized(ARGV, m), sized(ARGV, 2 * m), sized(ARGV, 2 * m)
  local n, at = 0, 0
  for k = 1, m do
    local i = 4 * k - 2
    local card = ARGV[i]
    if held[card] == ARGV[i + 1] then
      held[card] = nil
      if n == 0 then at = now_ms() end
      n = n + 2
      dues[n - 1], dues[n] = int(at + tonumber(ARGV[i + 2])), card
      states[n - 1], states[n] = card, ARGV[i + 3]
      out[k] = 1
    else
      out[k] = 0
    end
  end
  for k = 2 * m, n + 1, -1 do
    dues[k], states[k] = nil, nil
  end
  write_records(dues, states)
  return out
end

-- release(card, lease, due): gives the card back unpolled (no token was free), at the due time
-- it was fetched with, so it keeps its place among the due entries; its state is left as it is.
-- Returns 1, or 0 as ack.
if op == 'release' then
  local card = ARGV[2]
  if not holds(card, ARGV[3]) then return 0 end
  redis.call('ZADD', KEYS[1], tonumber(ARGV[4]), card)
  return 1
end

-- finish(card, lease): the card needs no more polls (its data is ready, its status final, or it
-- is unknown): both its records go. Returns 1, or 0 as ack.
if op == 'finish' then
  local card = ARGV[2]
  if not holds(card, ARGV[3]) then return 0 end
  redis.call('ZREM', KEYS[1], card)
  redis.call('HDEL', KEYS[3], card)
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

-- add(card, in_ms, ...): for each pair, the card's first poll is due in_ms from now, with a fresh
-- state, unless the card has an entry already (waiting or leased), which is left as it is.
-- Returns how many were added.
if op == 'add' then
  return add_all(2, function(i) return now_ms() + tonumber(ARGV[i + 1]) end,
    function() return '' end)
end

-- adopt(card, due_ms, state, ...): for each group of three, a card moved over from a polling
-- chain: due at due_ms with the chain's state ('' a fresh one), unless the card has an entry
-- already, which is left as it is. Returns how many were added.
if op == 'adopt' then
  return add_all(3, function(i) return tonumber(ARGV[i + 1]) end, function(i) return ARGV[i + 2] end)
end

-- merge(card, in_ms): a producer asks for a poll of the card in_ms from now. A card that waits
-- is brought forward to then (never put back); a leased card is being polled, and is left as it
-- is; a card without an entry is added, as by add. Returns 'started' when added, else 'merged'.
if op == 'merge' then
  local card = ARGV[2]
  local due = now_ms() + tonumber(ARGV[3])
  if add_new(card, due, '') == 1 then return 'started' end
  local s = tonumber(redis.call('ZSCORE', KEYS[1], card))
  if s < LEASED and s > due then redis.call('ZADD', KEYS[1], int(due), card) end
  return 'merged'
end

-- restart(card, in_ms): an operator starts the card's polling again (`enqueue`, `unpark`): its
-- state starts fresh (failures, deferrals and tally), and a card that waits is due in_ms from
-- now. A card a poll holds keeps its lease: that poll is the one asked for, and it sees the reset
-- (the state is no longer the one its fetch handed it), so it records no failure on it. Returns
-- 'started' (the card had no entry), 'restarted' (it waited) or 'running' (a poll holds it).
if op == 'restart' then
  local card = ARGV[2]
  local due = now_ms() + tonumber(ARGV[3])
  local s = redis.call('ZSCORE', KEYS[1], card)
  redis.call('HSET', KEYS[3], card, fresh())
  if s and tonumber(s) >= LEASED then return 'running' end
  redis.call('ZADD', KEYS[1], due, card)
  if s then return 'restarted' end
  return 'started'
end

-- remove(card): the card is polled no more. A running poll's acknowledgement then changes
-- nothing. Returns 1 when the card had an entry.
if op == 'remove' then
  redis.call('HDEL', KEYS[3], ARGV[2])
  return redis.call('ZREM', KEYS[1], ARGV[2])
end

-- head(): what the lateness gauges read: {now, the earliest due ms of an entry that waits or
-- whose lease ended (-1 when none), how many are due now}.
if op == 'head' then
  local at = now_ms()
  local first = redis.call('ZRANGE', KEYS[1], '-inf', at, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  local ended = redis.call('ZRANGE', KEYS[1], LEASED, LEASED + at, 'BYSCORE', 'LIMIT', 0, 1,
    'WITHSCORES')
  local earliest = first[2] and tonumber(first[2])
  if ended[2] then
    local e = tonumber(ended[2]) - LEASED
    if not earliest or e < earliest then earliest = e end
  end
  local due = redis.call('ZCOUNT', KEYS[1], '-inf', at)
    + redis.call('ZCOUNT', KEYS[1], LEASED, LEASED + at)
  return {at, earliest or -1, due}
end

return redis.error_reply('due_queue.lua: unknown op ' .. tostring(op))
