-- The due queue of one polling task shard, a timing wheel: a card's waiting poll is one string in
-- the list of its time slot, and nothing else is kept per card but one small hash field naming
-- that slot (and, while a poll holds the card, its lease). Every key a call touches is in KEYS and
-- carries the shard's hash tag, so the script runs on a Redis Cluster.
--
-- An entry is `due|state|card`: the due time (unix ms, Redis clock, 13 digits, so that entries
-- compare as strings by time), the poll state (`unchanged|last|since|failures[.deferrals]`, four
-- fields) and the card_ref, last, so that a card_ref may hold
-- any character. The entry travels with its poll: a fetch hands the state out with the card, and
-- the acknowledgement writes the successor's entry whole, so nothing on a poll's path looks a
-- card up.
--
-- KEYS[1] the slots: slot id -> its end (unix ms, Redis clock). A slot is a list of entries that
--         are all due by its end, in any order. The caller names the slot of each entry it
--         writes (cardworker_jobs::due::slot_id): one that ends a little after the entry is due
--         (by at most a twentieth of its delay, and 8.192 s), or, for an entry due already, one
--         that has ended. The id encodes the end and the width (see slot_end). A fetch takes
--         entries only from slots that ended: an entry is never handed out before its due time,
--         and at most its slot's width after.
-- KEYS[2] the shard's last lease score (a string).
-- KEYS[3] in flight: card_ref -> LEASED + the deadline of the lease a poll holds it under.
-- KEYS[4] the slots' lengths: slot id -> entries in its list (the lateness gauges' count).
-- KEYS[5] the leased entries: card_ref -> its entry, while its card is in flight.
-- KEYS[6..] the keys the op names, by position in its arguments: slot lists
--         (`…:slot:<id>`, the id after the last colon) and the cards' presence hashes (one of a
--         fixed number of buckets by card: card_ref -> the slot id of its waiting entry). A card
--         has a presence field exactly while it has an entry, waiting or leased; a leased card's
--         field names the slot it was fetched from.
-- ARGV[1] the op; the rest per op, below.
--
-- Slots are handed out in the order of their ends, each list from its head: a slot's entries in
-- the order they were written. No list is sorted or searched on a poll's path.
--
-- A lease is named by its score; every lease score the shard writes is above the last one it
-- wrote (KEYS[2]), so no two leases of a card share one, even when the card was acknowledged and
-- fetched again within one millisecond. Every op that names a lease acts only while that lease
-- holds the card (its score in flight), so a stale or repeated acknowledgement, release,
-- extension or finish changes nothing; a fetch takes only an entry that waits and is due, or
-- whose lease ended: one lease holds a card at a time.
local LEASED = 1125899906842624 -- 2^50 ms (about 35,000 years): above every due time

local now, now_b36
local function now_ms()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- `n` (a whole number) as the decimal string Redis reads: a Lua number handed to redis.call is
-- formatted with "%.17g", several times the cost of this.
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

-- The state of a card polled here for the first time.
local function fresh()
  return '0|0|s' .. stamp() .. '|0'
end

-- `state` when it has the four fields of a poll state, else a fresh one.
local function valid_state(state)
  if string.find(state, '^[^|]*|[^|]*|[^|]*|[^|]*$') then return state end
  return fresh()
end

-- The entry of `card` due at `due` (ms, a number or its digits) with `state`.
local function entry_of(due, state, card)
  return string.format('%013d|', due) .. state .. '|' .. card
end

-- An entry's due time (digits), state and card.
local function parse(entry)
  return string.match(entry, '^(%d+)|([^|]*|[^|]*|[^|]*|[^|]*)|(.*)$')
end

local function card_of(entry)
  local _, _, card = parse(entry)
  return card
end

local function slot_id(key)
  return string.match(key, ':(%d+)$')
end

-- A slot's end (unix ms) from its id: the end since 2025-01-01 in units of its width, times 16,
-- plus the width's power of two less 3 (cardworker_jobs::due::slot_id).
local SLOT_EPOCH_MS = 1735689600000
local function slot_end(id)
  local n = tonumber(id)
  local exp = n % 16
  return SLOT_EPOCH_MS + math.floor(n / 16) * 2 ^ (exp + 3)
end

-- The score of a lease written now that must end no earlier than `at`: above the shard's last.
local function next_lease(at)
  local lease = math.max(at, (tonumber(redis.call('GET', KEYS[2])) or 0) + 1)
  redis.call('SET', KEYS[2], int(lease))
  return lease
end

-- An acknowledgement reads a lease's holders as a score range while they are at most this many
-- times the cards named with it, else the named cards' scores: a holder costs Redis less to read
-- than a score, which it formats, but a range may hold cards nobody named.
local RANGE_READ_MAX = 3

-- Which of `cards` the lease `lease` (a score, as its caller was given it) holds: a set. A lease
-- that is not a whole number holds nothing (a range would fail the call on it). A fetch's cards
-- share one lease: a range of its holders, one more than RANGE_READ_MAX per card named, answers
-- for them all unless the lease holds more (a big fetch whose polls end one by one); then the
-- named cards' scores are read. A lone card's own score is read at once: one read either way.
local function holders(lease, cards)
  local held = {}
  if not string.match(lease, '^%d+$') then return held end
  if #cards > 1 then
    local cap = RANGE_READ_MAX * #cards + 1
    local range = redis.call('ZRANGE', KEYS[3], lease, lease, 'BYSCORE', 'LIMIT', '0', int(cap))
    if #range < cap then
      for _, c in ipairs(range) do held[c] = true end
      return held
    end
  end
  local want = tonumber(lease)
  local scores = redis.call('ZMSCORE', KEYS[3], unpack(cards))
  for k = 1, #cards do
    if scores[k] and tonumber(scores[k]) == want then held[cards[k]] = true end
  end
  return held
end

-- The leased entry of `card` and its lease score, or nil.
local function leased_entry(card)
  local score = redis.call('ZSCORE', KEYS[3], card)
  if not score then return nil end
  return redis.call('HGET', KEYS[5], card), score
end

-- Ends the lease of `cards` (their entries leave flight).
local function land(cards)
  if #cards == 0 then return end
  redis.call('ZREM', KEYS[3], unpack(cards))
  redis.call('HDEL', KEYS[5], unpack(cards))
end

-- The waiting entry of `card` in the slot list `key`, or nil.
local function waiting_entry(key, card)
  for _, e in ipairs(redis.call('LRANGE', key, '0', '-1')) do
    if card_of(e) == card then return e end
  end
  return nil
end

-- Forgets the slot `key`: its id leaves the slots' set and their lengths.
local function forget(key)
  local id = slot_id(key)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[4], id)
end

-- Counts `n` (negative: taken) more entries in the slot `key`'s length, and forgets the slot
-- when none is left.
local function count(key, n)
  if redis.call('HINCRBY', KEYS[4], slot_id(key), int(n)) <= 0 then forget(key) end
end

-- Removes the waiting `entry` from the slot list `key`.
local function unlist(key, entry)
  redis.call('LREM', key, '1', entry)
  count(key, -1)
end

-- Appends `entries` to the slot list `key` (every entry in it is due by its end), and names a
-- new slot in the slots' set.
local function insert(key, entries)
  if #entries == 0 then return end
  redis.call('RPUSH', key, unpack(entries))
  local id = slot_id(key)
  if redis.call('HINCRBY', KEYS[4], id, int(#entries)) == #entries then
    redis.call('ZADD', KEYS[1], int(slot_end(id)), id)
  end
end

-- The slot list and the presence hash a group names by position (ARGV values of KEYS indexes).
local function key_at(i)
  return KEYS[tonumber(i)]
end

-- Adds each card of the groups of `width` arguments from ARGV[2] (slot key index, presence key
-- index, card, then due(i) and state(i) at i, the group's fourth argument) that has no entry yet,
-- waiting or leased; a card named twice is added once, as first named. Returns how many were
-- added. One HMGET per presence bucket finds the cards that have an entry.
local function add_all(width, due, state)
  local by_bucket, order = {}, {}
  for i = 2, #ARGV, width do
    local b = ARGV[i + 1]
    if not by_bucket[b] then
      by_bucket[b] = {}
      order[#order + 1] = b
    end
    local cards = by_bucket[b]
    cards[#cards + 1] = i
  end
  local by_slot, slots, presence, seen, added = {}, {}, {}, {}, 0
  for _, b in ipairs(order) do
    local groups, cards = by_bucket[b], {}
    for k, i in ipairs(groups) do cards[k] = ARGV[i + 2] end
    local present = redis.call('HMGET', key_at(b), unpack(cards))
    local fields = {}
    for k, i in ipairs(groups) do
      local card = cards[k]
      if not present[k] and not seen[card] then
        seen[card] = true
        added = added + 1
        local sk = key_at(ARGV[i])
        if not by_slot[sk] then
          by_slot[sk] = {}
          slots[#slots + 1] = sk
        end
        local list = by_slot[sk]
        list[#list + 1] = entry_of(due(i + 3), valid_state(state(i + 4)), card)
        fields[#fields + 1] = card
        fields[#fields + 1] = slot_id(sk)
      end
    end
    if #fields > 0 then presence[#presence + 1] = {key_at(b), fields} end
  end
  for _, sk in ipairs(slots) do insert(sk, by_slot[sk]) end
  for _, p in ipairs(presence) do redis.call('HSET', p[1], unpack(p[2])) end
  return added
end

local op = ARGV[1]

-- fetch(max, lease_ms): KEYS[6..] the first slots by end, as the caller read them (a
-- `ZRANGE slots 0 n-1`). Leases at most `max` due entries: those whose lease ended (due again as
-- of its deadline) and those of the named slots that ended, the earliest due first among the
-- lists' heads, each leased until now + lease_ms. Returns a flat array: the Redis clock's now (ms), then card_ref, lease (its
-- score), due ms, state, for each entry taken; when none is due, {now, ms until the next one is}
-- ({now} for an empty shard). The caller names a successor's slot from that clock.
if op == 'fetch' then
  local max = tonumber(ARGV[2])
  local lease_ms = tonumber(ARGV[3])
  local at = now_ms()
  local ended = redis.call('ZRANGE', KEYS[3], int(LEASED), int(LEASED + at), 'BYSCORE', 'LIMIT',
    '0', ARGV[2], 'WITHSCORES')
  -- Each ended lease's entry, in its place (card -> entry) in `ended`.
  if #ended > 0 then
    local cards = {}
    for i = 1, #ended, 2 do cards[#cards + 1] = ended[i] end
    local entries = redis.call('HMGET', KEYS[5], unpack(cards))
    for k = 1, #cards do ended[2 * k - 1] = entries[k] or entry_of(0, fresh(), cards[k]) end
  end
  -- The entries of each named slot that ended, up to `max` in all: the slots after the first
  -- that has not ended have not either. A slot's taken entries are a prefix of its list.
  local lists, keys = {}, {}
  local scores = {}
  if #KEYS > 5 then
    local ids = {}
    for s = 6, #KEYS do ids[#ids + 1] = slot_id(KEYS[s]) end
    scores = redis.call('ZMSCORE', KEYS[1], unpack(ids))
  end
  local found = 0
  for s = 6, #KEYS do
    local score = scores[s - 5]
    if found >= max then break end
    if score then
      if tonumber(score) > at then break end
      local due = redis.call('LRANGE', KEYS[s], '0', int(max - found - 1))
      if #due == 0 then forget(KEYS[s]) end
      if #due > 0 then
        lists[#lists + 1] = due
        keys[#keys + 1] = KEYS[s]
        found = found + #due
      end
    end
  end
  if #ended == 0 and found == 0 then
    local first = redis.call('ZRANGE', KEYS[1], '0', '0', 'WITHSCORES')
    local held = redis.call('ZRANGE', KEYS[3], '0', '0', 'WITHSCORES')
    local next_at
    if first[2] then next_at = tonumber(first[2]) end
    if held[2] then
      local h = tonumber(held[2]) - LEASED
      if not next_at or h < next_at then next_at = h end
    end
    if not next_at then return {at} end
    return {at, math.max(next_at - at, 0)}
  end
  -- The earliest due first among the ended leases' entries and the slots' heads.
  -- Each list's head and its due time are kept as the heads move.
  local taken, dues, fresh_taken = {}, {}, {}
  local heads, head_due, j = {}, {}, 1
  local function due_of_head(l)
    local h = lists[l][heads[l]]
    return h and tonumber(string.sub(h, 1, 13))
  end
  for l = 1, #lists do
    heads[l] = 1
    head_due[l] = due_of_head(l)
  end
  while #taken < max do
    local best, best_due
    local e = ended[j] and (tonumber(ended[j + 1]) - LEASED)
    if e then best, best_due = 0, e end
    for l = 1, #lists do
      local d = head_due[l]
      if d and (not best_due or d < best_due) then best, best_due = l, d end
    end
    if not best then break end
    local n = #taken + 1
    if best == 0 then
      taken[n] = ended[j]
      j = j + 2
    else
      taken[n] = lists[best][heads[best]]
      heads[best] = heads[best] + 1
      head_due[best] = due_of_head(best)
      fresh_taken[n] = true
    end
    dues[n] = best_due
  end
  for l = 1, #lists do
    local t = heads[l] - 1
    if t > 0 then
      redis.call('LTRIM', keys[l], int(t), '-1')
      count(keys[l], -t)
    end
  end
  local lease = next_lease(LEASED + at + lease_ms)
  local lease_s = int(lease)
  -- One ZADD leases every card taken; one HSET keeps the entries taken from the slots (an ended
  -- lease's entry is kept already).
  local z, h, out = {}, {}, {at}
  for k = 1, #taken do
    local _, state, card = parse(taken[k])
    z[2 * k - 1], z[2 * k] = lease_s, card
    if fresh_taken[k] then
      h[#h + 1] = card
      h[#h + 1] = taken[k]
    end
    local o = 4 * k + 1
    out[o - 3], out[o - 2], out[o - 1], out[o] = card, lease, dues[k], state
  end
  redis.call('ZADD', KEYS[3], unpack(z))
  if #h > 0 then redis.call('HSET', KEYS[5], unpack(h)) end
  return out
end

-- batch(slot, presence, card, lease, next_in_ms, state, ...): for each group of six, the poll
-- under `lease` is over and its card is due again next_in_ms from now (the successor) with
-- `state`, in the slot list and presence hash at those KEYS positions. Returns one number a
-- group: 1, or 0 when `lease` no longer holds the card (it ended and the card was leased again,
-- it was acknowledged already, or the card was removed), and nothing changed for it. A card
-- named twice is acknowledged once: its first successor ends the lease the second names.
if op == 'batch' then
  -- The cards named with each lease, then which of them each lease holds (read once per lease).
  local named, leases = {}, {}
  for k = 1, (#ARGV - 1) / 6 do
    local i = 6 * k - 4
    local lease = ARGV[i + 3]
    if not named[lease] then
      named[lease] = {}
      leases[#leases + 1] = lease
    end
    local cards = named[lease]
    cards[#cards + 1] = ARGV[i + 2]
  end
  local held_by = {}
  for _, lease in ipairs(leases) do held_by[lease] = holders(lease, named[lease]) end
  local out, gone, by_slot, slots, by_bucket, buckets, due_in = {}, {}, {}, {}, {}, {}, {}
  local slot_ids = {}
  for k = 1, (#ARGV - 1) / 6 do
    local i = 6 * k - 4
    local held = held_by[ARGV[i + 3]]
    local card = ARGV[i + 2]
    if held[card] then
      held[card] = nil
      gone[#gone + 1] = card
      local a = ARGV[i + 4]
      local due = due_in[a]
      if not due then
        due = string.format('%013d|', now_ms() + tonumber(a))
        due_in[a] = due
      end
      local sk, bk = key_at(ARGV[i]), key_at(ARGV[i + 1])
      local list = by_slot[sk]
      if not list then
        list = {}
        by_slot[sk] = list
        slots[#slots + 1] = sk
        slot_ids[sk] = slot_id(sk)
      end
      list[#list + 1] = due .. valid_state(ARGV[i + 5]) .. '|' .. card
      local fields = by_bucket[bk]
      if not fields then
        fields = {}
        by_bucket[bk] = fields
        buckets[#buckets + 1] = bk
      end
      fields[#fields + 1] = card
      fields[#fields + 1] = slot_ids[sk]
      out[k] = 1
    else
      out[k] = 0
    end
  end
  land(gone)
  for _, sk in ipairs(slots) do insert(sk, by_slot[sk]) end
  for _, bk in ipairs(buckets) do redis.call('HSET', bk, unpack(by_bucket[bk])) end
  return out
end

-- release(card, lease, due): KEYS[6] the slot list of `due`, KEYS[7] the card's presence hash.
-- Gives the card back unpolled (no token was free) at the due time it was fetched with, so it
-- keeps its place among the due entries; its state is left as it is. Returns 1, or 0 as batch.
if op == 'release' then
  local card = ARGV[2]
  if not holders(ARGV[3], {card})[card] then return 0 end
  local e = redis.call('HGET', KEYS[5], card)
  local state = fresh()
  if e then
    local _, s = parse(e)
    state = s or state
  end
  land({card})
  insert(KEYS[6], {entry_of(tonumber(ARGV[4]), state, card)})
  redis.call('HSET', KEYS[7], card, slot_id(KEYS[6]))
  return 1
end

-- finish(card, lease): KEYS[6] the card's presence hash. The card needs no more polls: its entry
-- and presence go. Returns 1, or 0 as batch.
if op == 'finish' then
  local card = ARGV[2]
  if not holders(ARGV[3], {card})[card] then return 0 end
  land({card})
  redis.call('HDEL', KEYS[6], card)
  return 1
end

-- extend(card, lease, lease_ms): the poll under `lease` runs on; its lease ends lease_ms from
-- now (or a little later), unless it ends later already. Returns the lease's score from now on,
-- or 0 when `lease` no longer holds the card.
if op == 'extend' then
  local card = ARGV[2]
  if not holders(ARGV[3], {card})[card] then return 0 end
  local held = tonumber(ARGV[3])
  local want = LEASED + now_ms() + tonumber(ARGV[4])
  if want <= held then return held end
  local lease = next_lease(want)
  redis.call('ZADD', KEYS[3], int(lease), card)
  return lease
end

-- add(slot, presence, card, in_ms, ...): for each group of four, the card's first poll is due
-- in_ms from now with a fresh state, unless the card has an entry already (waiting or leased),
-- which is left as it is. Returns how many were added.
if op == 'add' then
  return add_all(4, function(i) return now_ms() + tonumber(ARGV[i]) end,
    function() return '' end)
end

-- adopt(slot, presence, card, due_ms, state, ...): for each group of five, a card moved over
-- from another layout: due at due_ms with its state ('' a fresh one), unless the card has an
-- entry already, which is left as it is. Returns how many were added.
if op == 'adopt' then
  return add_all(5, function(i) return tonumber(ARGV[i]) end, function(i) return ARGV[i] end)
end

-- The ops below name one card whose waiting entry they may move: the caller reads its presence
-- first (HGET) and names the slot it found (`seen`, '' for none) with that slot's list as
-- KEYS[8]. When the presence changed in between, the op changes nothing and answers 'moved', and
-- the caller reads again. KEYS[6] is the card's presence hash, KEYS[7] the slot list of the due
-- time the op asks for (the same key as KEYS[8] when they coincide).
local function seen_ok(card, seen)
  local p = redis.call('HGET', KEYS[6], card)
  return (p or '') == seen, p
end

-- merge(card, in_ms, seen): a producer asks for a poll of the card in_ms from now. A card that
-- waits is brought forward to then (never put back); a leased card is being polled, and is left
-- as it is; a card without an entry is added with a fresh state. Returns 'started' when added,
-- 'merged' when it had an entry, or 'moved'.
if op == 'merge' then
  local card = ARGV[2]
  local ok, p = seen_ok(card, ARGV[4])
  if not ok then return 'moved' end
  local due = now_ms() + tonumber(ARGV[3])
  local state = fresh()
  if p then
    local e = waiting_entry(KEYS[8], card)
    if e then
      local d, s = parse(e)
      if tonumber(d) <= due then return 'merged' end
      unlist(KEYS[8], e)
      state = s
    elseif leased_entry(card) then
      return 'merged'
    else
      p = nil
    end
  end
  insert(KEYS[7], {entry_of(due, state, card)})
  redis.call('HSET', KEYS[6], card, slot_id(KEYS[7]))
  if p then return 'merged' end
  return 'started'
end

-- restart(card, in_ms, seen): an operator starts the card's polling again (`enqueue`, `unpark`):
-- its state starts fresh (failures, deferrals and tally), and a card that waits is due in_ms
-- from now. A card a poll holds keeps its lease, and its leased entry gets the fresh state: that
-- poll is the one asked for. Returns 'started' (the card had no entry), 'restarted' (it waited),
-- 'running' (a poll holds it) or 'moved'.
if op == 'restart' then
  local card = ARGV[2]
  local ok, p = seen_ok(card, ARGV[4])
  if not ok then return 'moved' end
  local verdict = 'started'
  if p then
    local e = waiting_entry(KEYS[8], card)
    if e then
      unlist(KEYS[8], e)
      verdict = 'restarted'
    else
      local l = leased_entry(card)
      if l then
        local d = parse(l)
        redis.call('HSET', KEYS[5], card, entry_of(tonumber(d) or 0, fresh(), card))
        return 'running'
      end
    end
  end
  insert(KEYS[7], {entry_of(now_ms() + tonumber(ARGV[3]), fresh(), card)})
  redis.call('HSET', KEYS[6], card, slot_id(KEYS[7]))
  return verdict
end

-- remove(card, seen): KEYS[7] the slot list of `seen` (no KEYS[8]). The card is polled no
-- more: its entry, waiting or leased, and its presence go, and a running poll's acknowledgement
-- changes nothing. Returns 1 when the card had an entry, 0 when not, -1 when moved.
if op == 'remove' then
  local card = ARGV[2]
  local ok, p = seen_ok(card, ARGV[3])
  if not ok then return -1 end
  if not p then return 0 end
  local e = waiting_entry(KEYS[7], card)
  if e then
    unlist(KEYS[7], e)
  else
    if leased_entry(card) then land({card}) end
  end
  redis.call('HDEL', KEYS[6], card)
  return 1
end

-- entry(card, seen): KEYS[7] the slot list of `seen`. Where the card stands: {'waiting', due ms,
-- state}, {'leased', lease deadline ms, state}, {} when it has no entry, or {'moved'}. For
-- `investigate` and the console.
if op == 'entry' then
  local card = ARGV[2]
  local ok, p = seen_ok(card, ARGV[3])
  if not ok then return {'moved'} end
  if not p then return {} end
  local e = waiting_entry(KEYS[7], card)
  if e then
    local d, s = parse(e)
    return {'waiting', tonumber(d), s}
  end
  local l, score = leased_entry(card)
  if l then
    local _, s = parse(l)
    return {'leased', tonumber(score) - LEASED, s}
  end
  return {}
end

-- head(): what the lateness gauges read: {now, the earliest due ms of an entry that is due (the end
-- of the first slot that ended, or the deadline of the first lease that did; -1 when none), how
-- many are due now (the entries of the slots that ended, and the ended leases)}.
if op == 'head' then
  local at = now_ms()
  local first = redis.call('ZRANGE', KEYS[1], '0', '0', 'WITHSCORES')
  local ended = redis.call('ZRANGE', KEYS[3], int(LEASED), int(LEASED + at), 'BYSCORE', 'LIMIT',
    '0', '1', 'WITHSCORES')
  local earliest
  if first[2] and tonumber(first[2]) <= at then earliest = tonumber(first[2]) end
  if ended[2] then
    local e = tonumber(ended[2]) - LEASED
    if not earliest or e < earliest then earliest = e end
  end
  local due = redis.call('ZCOUNT', KEYS[3], int(LEASED), int(LEASED + at))
  local ids = redis.call('ZRANGE', KEYS[1], '-inf', int(at), 'BYSCORE')
  -- Their lengths, a thousand slots a read (unpack takes some thousands of values).
  for first = 1, #ids, 1000 do
    local part = {unpack(ids, first, math.min(first + 999, #ids))}
    for _, n in ipairs(redis.call('HMGET', KEYS[4], unpack(part))) do due = due + (tonumber(n) or 0) end
  end
  return {at, earliest or -1, due}
end

return redis.error_reply('due_queue.lua: unknown op ' .. tostring(op))
