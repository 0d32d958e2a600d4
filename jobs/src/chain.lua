-- Polling chains: at most one live chain per card and task. The one script every chain write goes
-- through: the worker (start, schedule, check, finish, reconcile) and the producer API (merge).
--
-- KEYS[1] chain hash (card_ref -> "chain_id|unchanged|last|since|state", see below)
-- KEYS[2] intake zset of the queue (entries with a payload of their own: a raw producer's, `dead
--         requeue`'s, or one written by an older release that stored poll payloads there)
-- KEYS[3] intake payload hash of the queue
-- KEYS[4] the chain due set (card_ref -> score): the chains' one sorted set, both the polling intake
--         and the index reconcile reads (no payload and no second set per waiting poll). Score =
--         the due ms of the chain's next poll while it waits to be fed; FED + that due ms once its
--         job exists elsewhere (fed into apalis, running, or waiting in KEYS[2] with a payload of
--         its own). The feeder reads only scores below FED, so it never feeds a chain whose job may
--         still be alive; reconcile reads both ranges past the grace.
-- ARGV[1] op: start | start_if_dead | drop_if_dead | schedule | defer | check | finish | merge |
--         reassert,
--         or `batch`:
--         then ARGV[2..] are groups of exactly 8 values, each the ARGV[1..8] of one call (unused
--         ones ''), and the script returns the list of their results, in order (one process's
--         concurrent checks and successors cost one script call per task, not one each)
-- ARGV[2] card_ref  ARGV[3] chain id (job's; the new one for start*/merge)
-- ARGV[4] delay ms (start*/schedule/defer/merge), or a fresh id (check)
-- ARGV[5] failures, ARGV[6] deferrals of the job to schedule (start*/schedule/defer/merge): kept in
--         the chain entry, from which the feeder builds the job's payload; for check: the checker's
--         lease TTL ms (how long a run marker can stand, see The run marker below)
-- ARGV[7] grace ms (start_if_dead, drop_if_dead), or how long a chain without a waiting entry counts as
--         live past its due time (merge), or the tally (schedule): 'u' one more unchanged poll,
--         'r' reset by a recorded change or failure, anything else keeps it; for defer: how long
--         a run marker stands (ms, the lease TTL)
-- ARGV[8] the job's turn (check, schedule, defer, finish): the due ms its job was fed for, '' or absent
--         when unknown (a payload of its own, an adopted card); see Turns below
-- Returns: start*, drop_if_dead: 1 done / 0 left alone (live); schedule: 1 / 0 stale; defer: 1 /
--          0 stale / {'running', ms} when another delivery of the same job runs its poll (nothing
--          written; write again once it has had that long); check: 1 when the job's chain is
--          live, else {state, chain id} with state 'stale' | 'adopted', or {'busy', ms} when a
--          replaced chain's poll may still run (wait, then check again), or {'running', ms} when
--          another delivery of the same job runs its poll (as for defer);
--          finish: 1 / 0 stale;
--          merge: {'merged' | 'started', chain id}.
--
-- The chain entry's tally (the unchanged-poll facts live with the chain, so they cost no key of
-- their own and go when the chain goes): `unchanged` polls counted since `since`, the time
-- of the `last` one (base-36 unix seconds, '0' for none), and `since` as a kind letter plus base-36
-- unix seconds: 'c' the chain's last recorded change or failure, 's' the chain's start (a first
-- start, `enqueue`, reconcile, an adoption after Redis lost its data): nothing before it is known.
-- Then `state`, the next job's failures, or `failures.deferrals` when it was deferred: a waiting
-- poll has no payload of its own.
--
-- Generations: a chain id is the chain's fencing token. A restart (start, start_if_dead, a merge
-- that starts a chain) writes a new id, so every op of a job of the replaced chain answers stale.
--
-- Turns: the feeder writes into each job the due time it was fed for (its turn), and re-scores the
-- entry to FED + that time. A job's check, schedule and finish act only while the entry is still
-- at FED + its turn: a second delivery of a job whose turn is over (apalis re-queueing a worker's
-- jobs after its stream ended, while the job itself ran on) is stale, though its chain is live.
--
-- The run marker: a live check appends `chain#turn@ms` to the entry as a sixth field (`chain@ms`
-- for a job of unknown turn): from then on the poll may be at the Gateway. While it stands (for
-- the checker's lease TTL, ARGV[5], at most: the poll is over by then), any other job of the card
-- (a restarted chain's first, a later turn) is told to wait ({'busy', ms to wait}) instead of
-- polling the card a second time at once. A restart keeps the marker. The poll's own schedule or
-- finish removes it, whether its chain is still live or not; a check that finds it expired drops
-- it. Readers that take the first five fields (feed.lua, the Rust parsers) never see it.
--
-- Second deliveries: apalis may hand a job out again while its first delivery runs (a worker's
-- stream ended, a peer's orphan recovery). Such a delivery never polls and never writes the
-- successor while the first one's marker stands: its check, and `defer` (the budget's deferral,
-- which runs before any check and so never holds a marker), answer {'running', ms left}, and its
-- caller writes the deferral again once the marker has had that long. By then the first delivery
-- has written its successor (the write is stale by turn) or is gone with its process (the marker
-- expired: the write goes on, so a delivery that died after its check never leaves the chain
-- without a job).
--
-- Older entries still parse: `chain_id|due_ms` (without a tally) and `chain_id|u|l|s` (without the
-- next job's state: their job carries its own payload). Those two are written only by an older
-- release, whose jobs carry their own payload in KEYS[2]/KEYS[3]: the feeder never builds a payload
-- from them (it tells them by their fewer fields), it only moves their KEYS[4] entry to the FED
-- range (their job lives in the intake or in apalis).
--
-- The fleet-wide hourly counter of unchanged polls is not written here: each process adds its
-- unchanged polls up and writes them every few seconds (`polling::unchanged`), not one INCR per
-- poll.
--
-- The Redis clock is read only by the ops that need it: a live `check` (every poll, before its
-- Gateway call) and `finish` read none (TIME is a command of its own on the hottest ops).
local FED = 1125899906842624 -- 2^50 ms (about 35,000 years): above every due time
-- One call's arguments (ARGV[1..8], or one group of a batch), set before each call.
local op, card, chain, A4, A5, A6, A7, A8
local now_s, now
local function clock()
  if not now then
    local t = redis.call('TIME')
    now_s = tonumber(t[1])
    now = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- The card's chain entry, read before each call: its id, an older release's due time, its tally,
-- the raw entry and its run marker (`old_id@ms`, see the header), if any.
local cur_id, legacy_due, cur_tally, cur_raw, cur_run, cur_five
local function load()
  cur_id, legacy_due, cur_tally, cur_raw, cur_run, cur_five = nil, nil, nil, nil, nil, false
  local cur = redis.call('HGET', KEYS[1], card)
  if not cur then return end
  cur_raw = cur
  -- No other field holds an '@': one plain find keeps the common entry at one match.
  if string.find(cur, '@', 1, true) then
    cur_run = string.match(cur, '|([^|@]+@%d+)$')
  end
  -- Every entry this release writes starts with four non-empty fields: one `string.match` reads
  -- them (splitting into a table costs as much Redis CPU as the HGET). Anything else (an older
  -- format, or a field left empty by hand) is split into a table, empty fields skipped.
  local id, unchanged, last, since = string.match(cur, '^([^|]+)|([^|]+)|([^|]+)|([^|]+)')
  if id then
    cur_id, cur_tally = id, {tonumber(unchanged) or 0, last, since}
    -- The match ends at the fourth field: anything after it is the fifth and later ones.
    cur_five = #cur > #id + #unchanged + #last + #since + 3
    return
  end
  local f = {}
  for p in string.gmatch(cur, '[^|]+') do f[#f + 1] = p end
  cur_id = f[1]
  if #f == 2 then
    legacy_due = tonumber(f[2])
  elseif #f >= 4 then
    cur_tally = {tonumber(f[2]) or 0, f[3], f[4]}
  end
end

local DIGITS = '0123456789abcdefghijklmnopqrstuvwxyz'
local function b36(n)
  if n <= 0 then return '0' end
  local s = ''
  while n > 0 do
    local d = n % 36
    s = string.sub(DIGITS, d + 1, d + 1) .. s
    n = math.floor(n / 36)
  end
  return s
end

-- The Redis clock's seconds in base 36, made once per script call (a batch's ops share it).
local now_b36
local function stamp()
  if not now_b36 then
    clock()
    now_b36 = b36(now_s)
  end
  return now_b36
end

local function fresh()
  return {0, '0', 's' .. stamp()}
end

-- The card's entry in the due set: (score, whether it is in the FED range), or nil.
local function cur_score()
  local s = redis.call('ZSCORE', KEYS[4], card)
  if not s then return nil end
  s = tonumber(s)
  return s, s >= FED
end

-- The due time of the card's current chain (nil when unknown: counts as dead).
local function cur_due()
  local s, fed = cur_score()
  if s then
    if fed then return s - FED end
    return s
  end
  return legacy_due
end

-- The next job's state as the entry's fifth field: `failures`, or `failures.deferrals` when it
-- was deferred (most entries end in `|0`: an entry's size class is what costs memory).
local function state_field(failures, deferrals)
  local f, d = tonumber(failures) or 0, tonumber(deferrals) or 0
  if d > 0 then return f .. '.' .. d end
  return tostring(f)
end

local function mark(id, tally, failures, deferrals, score, run)
  local entry = id .. '|' .. tally[1] .. '|' .. tally[2] .. '|' .. tally[3]
    .. '|' .. state_field(failures, deferrals)
  if run then entry = entry .. '|' .. run end
  redis.call('HSET', KEYS[1], card, entry)
  redis.call('ZADD', KEYS[4], score, card)
end

-- The calling job's turn (ARGV[8]) as a string of digits, or nil when unknown.
local function turn()
  if A8 and string.find(A8, '^%d+$') and A8 ~= '0' then return A8 end
  return nil
end

-- Whether the calling job's turn is still the chain's: its entry in the due set is FED + the turn.
-- A job of unknown turn always is.
local function turn_current()
  local t = turn()
  if not t then return true end
  local s, fed = cur_score()
  return fed and s == FED + tonumber(t)
end

-- The standing run marker read: (chain id, turn or nil, since ms), or nil without one.
local function marker()
  if not cur_run then return nil end
  local who, since = string.match(cur_run, '^(.+)@(%d+)$')
  if not who then return nil end
  local id, t = string.match(who, '^(.*)#(%d+)$')
  if id then return id, t, tonumber(since) end
  return who, nil, tonumber(since)
end

-- Whether the standing marker is the run of chain `id` at turn `t` (nil: unknown turn): its
-- text starts with `id#t@` (`id@` for an unknown turn).
local function marker_is(id, t)
  if not cur_run then return false end
  local want = id
  if t then want = id .. '#' .. t end
  return string.sub(cur_run, 1, #want + 1) == want .. '@'
end

-- The run marker a restart leaves for the new chain: the one standing (its poll may still run).
local function restart_marker()
  return cur_run
end

-- Removes the run marker from the entry (its poll is over, or it expired).
local function drop_marker()
  if not cur_run then return end
  cur_raw = string.sub(cur_raw, 1, #cur_raw - #cur_run - 1)
  redis.call('HSET', KEYS[1], card, cur_raw)
  cur_run = nil
end

-- The poll of chain `id` at turn `t` ends: its run marker goes.
local function release_marker(id, t)
  if id ~= '' and marker_is(id, t) then drop_marker() end
end

-- Lowers the intakes' due hint (`{prefix}:intakes:due`, keys::intake_due_hint) to an entry's due
-- time, so that the feeder, which reads the hint rather than every intake, looks at this queue by
-- then. Its member is the queue's intake key (KEYS[2]), whichever of the queue's two sets holds the
-- entry; its name is made from that key's prefix, as the queue scripts make apalis's meta keys, so
-- that no caller passes it. The hint is written once per script call, with the earliest due time of
-- all its calls (a batch of successors costs one hint write, not one each): `hint` notes it,
-- `write_hint` writes it.
local hint_due
local function hint(due)
  if not hint_due or due < hint_due then hint_due = due end
end
local function write_hint()
  if not hint_due then return end
  local prefix = string.match(KEYS[2], '^(.*):intake:[^:]*$')
  if prefix and redis.call('ZADD', prefix .. ':intakes:due', 'LT', 'CH', hint_due, KEYS[2]) == 1 then
    -- Lowered: announce it, so that a feeder sleeping until a later time feeds it in time.
    redis.call('PUBLISH', prefix .. ':intakes:wake', hint_due)
  end
end

local function put(id, delay, tally, run)
  local due = clock() + tonumber(delay)
  mark(id, tally, A5, A6, due, run)
  hint(due)
end

-- A job of a replaced chain that waits with a payload of its own would only run as stale.
local function drop_payload_entry()
  redis.call('ZREM', KEYS[2], card)
  redis.call('HDEL', KEYS[3], card)
end

local function run()
  if op == 'start' then
    put(chain, A4, fresh(), restart_marker())
    drop_payload_entry()
    return 1
  elseif op == 'start_if_dead' or op == 'drop_if_dead' then
    local s = cur_score()
    local due = cur_id and cur_due()
    if due and due + tonumber(A7) > clock() then
      -- Live. An entry from before the due index had its due time in the hash: index it (its job
      -- exists elsewhere), since reconcile reads the index.
      if not s then redis.call('ZADD', KEYS[4], FED + due, card) end
      return 0
    end
    if op == 'start_if_dead' then
      put(chain, A4, fresh(), restart_marker())
      drop_payload_entry()
    else
      -- Reconcile found an overdue chain of a card that needs no polling any more.
      redis.call('HDEL', KEYS[1], card)
      redis.call('ZREM', KEYS[4], card)
    end
    return 1
  elseif op == 'schedule' then
    -- A chain whose entry is gone (Redis lost it while the job ran) is adopted by its job: the
    -- successor is written, so the card is never left without one.
    if (cur_id and cur_id ~= chain) or (cur_id and not turn_current()) then
      -- Replaced, or this job's turn is over: its poll (if it ran) ends here, nothing written.
      release_marker(chain, turn())
      return 0
    end
    local tally = cur_tally or fresh()
    local mode = A7
    if mode == 'u' then
      tally[1] = tally[1] + 1
      tally[2] = stamp()
    elseif mode == 'r' then
      tally[1] = 0
      tally[3] = 'c' .. stamp()
    end
    local run = cur_run
    if marker_is(chain, turn()) then run = nil end
    put(chain, A4, tally, run)
    return 1
  elseif op == 'defer' then
    -- The budget deferred the job before its check: the same write as schedule's, tally kept,
    -- except while another delivery of this very job holds the run marker (see Second deliveries).
    if (cur_id and cur_id ~= chain) or (cur_id and not turn_current()) then return 0 end
    if marker_is(chain, turn()) then
      local _, _, since = marker()
      local left = since + (tonumber(A7) or 0) - clock()
      if left > 0 then return {'running', tostring(left)} end
      -- Expired: the delivery that wrote it is gone, and this write takes the turn over.
      drop_marker()
    end
    put(chain, A4, cur_tally or fresh(), cur_run)
    return 1
  elseif op == 'check' then
    if not cur_id then
      -- The chain state was lost (Redis flushed, or a legacy producer enqueued without a chain):
      -- adopt the job, which is running (FED). Worst case one extra poll if reconcile also
      -- restarted the card.
      local id, t = chain, turn()
      if id == '' then id = A4 end
      -- Fed at its turn, as far as it knows (so that its own successor passes the turn check),
      -- and at the Gateway from now on.
      local who = id
      if t then who = id .. '#' .. t end
      mark(id, fresh(), 0, 0, FED + (tonumber(t) or clock()), who .. '@' .. clock())
      return {'adopted', id}
    elseif cur_id == chain then
      -- A second delivery of a job whose turn is over: the chain has moved on without it.
      if not turn_current() then return {'stale', cur_id} end
      local t = turn()
      local mid, mt, since = marker()
      if mid then
        local left = since + (tonumber(A5) or 0) - clock()
        if left > 0 then
          -- This very turn may be at the Gateway already (a second delivery of the running job):
          -- no poll, and no successor, until the first delivery's marker has stood its time.
          if mid == chain and mt == t then return {'running', tostring(left)} end
          -- Another poll of the card may still run (a replaced chain's, an earlier turn's):
          -- wait for it, at most the checker's lease TTL.
          return {'busy', tostring(left)}
        end
        drop_marker()
      end
      -- The poll starts: its run marker stands until its own schedule or finish. An entry in an
      -- older format (fewer than five fields) gets none: appending to it would change how it
      -- parses.
      if cur_five then
        local who = chain
        if t then who = chain .. '#' .. t end
        redis.call('HSET', KEYS[1], card, cur_raw .. '|' .. who .. '@' .. clock())
      end
      -- The common answer is a bare 1: the caller knows its own chain id.
      return 1
    elseif chain == '' then
      local s, fed = cur_score()
      if (not s or fed) and not redis.call('ZSCORE', KEYS[2], card) then
        -- A chain-less job (written raw, or by a producer from before the merge) that took the
        -- place of the chain's own waiting entry: it joins the chain instead of ending it.
        mark(cur_id, cur_tally or fresh(), 0, 0, FED + clock(), cur_run)
        return {'adopted', cur_id}
      end
    end
    -- A job of a replaced chain that never started its poll: the marker is not its own.
    return {'stale', cur_id}
  elseif op == 'reassert' then
    -- Redis came back empty while this chain's poll (ARGV[5] failures, ARGV[8] turn) was at the
    -- Gateway: its entry comes back as it was when the poll checked in, with its run marker, so
    -- that reconcile finds the chain live and another job of the card waits for the poll.
    if cur_id then return 0 end
    local t = turn()
    local who = chain
    if t then who = chain .. '#' .. t end
    mark(chain, fresh(), A5, 0, FED + (tonumber(t) or clock()), who .. '@' .. clock())
    return 1
  elseif op == 'finish' then
    if (cur_id and cur_id ~= chain) or (cur_id and not turn_current()) then
      release_marker(chain, turn())
      return 0
    end
    redis.call('HDEL', KEYS[1], card)
    redis.call('ZREM', KEYS[4], card)
    return 1
  elseif op == 'merge' then
    -- A producer asks for a poll of a card. A live chain keeps its own job (with its failure count
    -- and deferrals); its waiting poll is only brought forward. Without a live chain, a new one
    -- starts with the producer's job.
    local due = clock() + tonumber(A4)
    if cur_id then
      local with_payload = redis.call('ZSCORE', KEYS[2], card)
      if with_payload then
        if tonumber(with_payload) > due then
          redis.call('ZADD', KEYS[2], due, card)
          hint(due)
        end
        return {'merged', cur_id}
      end
      local s, fed = cur_score()
      if s and not fed then
        if s > due then
          redis.call('ZADD', KEYS[4], due, card)
          hint(due)
        end
        return {'merged', cur_id}
      end
      -- Nothing waits: the chain's job is being fed or run, unless the chain is long overdue.
      local was_due = cur_due()
      if was_due and was_due + tonumber(A7) > now then
        return {'merged', cur_id}
      end
    end
    put(chain, A4, fresh(), restart_marker())
    drop_payload_entry()
    return {'started', chain}
  end
  return redis.error_reply('unknown chain op ' .. tostring(op))
end

if ARGV[1] == 'batch' then
  local out = {}
  for i = 2, #ARGV - 7, 8 do
    op, card, chain, A4, A5, A6, A7, A8 = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3],
      ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    load()
    out[#out + 1] = run()
  end
  write_hint()
  return out
end
op, card, chain, A4, A5, A6, A7, A8 =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
load()
local result = run()
write_hint()
return result
