-- The polling budget: leases in sorted sets scored by expiry (unix ms on the REDIS clock).
-- Every key shares the hash tag {budget}, so the script stays valid on Redis Cluster.
-- circuit.lua is prepended to this text (budget/circuit.rs): acquire also asks the task's
-- circuit, and finish also counts the poll's outcome in it. It also defines clock(): Redis TIME,
-- read at most once per call and only by the ops that need it (a release needs none).
--
-- KEYS[1] total lease zset   KEYS[2] carddata lease zset   KEYS[3] card_status lease zset
-- KEYS[4] overrides hash (task -> limit)   KEYS[5] paused set (task labels)
-- KEYS[6] carddata circuit hash   KEYS[7] card_status circuit hash
-- KEYS[8] carddata circuit window list   KEYS[9] card_status circuit window list
-- KEYS[10] waiters zset (process id -> until ms: it was refused a token lately)
-- KEYS[11] expired hash (scope -> leases removed because they had expired, never released:
--          cardworker_budget_leases_expired_total{scope})
-- KEYS[12] kept hash (process id -> "expiry ms|carddata slot ids|card_status slot ids", the
--          ids space-separated: the idle slots the process kept at its last renewal)
-- KEYS[13] fence hash: 'run_id' (the redis-server that holds the budget's data) and 'until' (unix
--          ms on the Redis clock: no poll is admitted before it). See "The fence" below.
-- (a task's circuit hash is KEYS[task index + 4], its window KEYS[task index + 6])
-- ARGV[1] op: acquire | release | finish | finish_batch | renew | show | circuit_force | reassert |
--          extend | fence
--
-- acquire: ARGV[2] task index (2 = carddata, 3 = card_status, i.e. its KEYS index)
--          ARGV[3] task label  ARGV[4] lease id  ARGV[5] total limit  ARGV[6] config task limit
--          ARGV[7] limit ceiling  ARGV[8] lease ttl ms  ARGV[9] circuit cfg (circuit_cfg)
--          ARGV[10] '1' when the acquire may take over the lease of a carried finish (below)
--          ARGV[11] the process id (its entry in the waiters set when it is refused a token)
--          ARGV[12] how many finishes it carries, then 6 values per finish: task index, lease
--          id, outcome, probe round, card (as for finish), successes of that task to count
--          before it (circuit_successes). They run first, in the same call, so a slot that turns
--          over costs one round trip, not two. A finish with an empty lease id only counts its
--          outcome: its poll's lease stays held while its call may still be at the Gateway.
--          After them: the fence length in ms, then the first-start mark ('' when none; see
--          "The fence").
--   Taking over (ARGV[10] = '1'): the poll admitted by this call gets the lease id of one carried
--   finish (one of its own task if any, else the first), and that member is re-scored in place
--   (one ZADD per set) instead of removed and added again. The slot never looks free in
--   between, so the limits are checked counting it as this poll's: a limit lowered meanwhile
--   still refuses (and the carried lease is then removed, as a plain finish would).
--   A refusal for want of a token (total or task) also writes the process into the waiters set
--   for WAITER_MS: while another process waits, renew stops every process from keeping idle slots
--   (budget/pool.rs), so a busy pod cannot keep the budget to itself.
--   returns {granted 1|0, reason 'ok'|'total'|'task'|'paused'|'circuit_open'|'fenced', effective task
--            limit, invalid override as stored ('' when none or valid), probe round (0: not a
--            probe), circuit transition ('' | 'half_open'), ms until the cool-down or the fence
--            ends,
--            {the carried finishes' answers, each as finish returns it}, the lease id granted
--            ('' when none: ARGV[4], or the carried lease taken over)}
-- release: ARGV[2..] lease ids; removes each from every set. Returns how many leases existed.
-- finish:  ARGV[2] task index  ARGV[3] lease id  ARGV[4] outcome 'ok'|'fail'|'none'
--          ARGV[5] probe round (0: not a probe)  ARGV[6] circuit cfg  ARGV[7] the card
--   releases the lease and counts the outcome; returns {existed 1|0, transition name ('' for
--   none), {its numbers}} (see circuit_record).
-- finish_batch: ARGV[2] circuit cfg, ARGV[3] how many finishes, then 6 values each (as the
--   finishes an acquire carries); returns their answers. A process flushes with it the finishes
--   that no acquire picked up within a few ms.
-- renew: the slots a process keeps between its polls (budget/pool.rs). ARGV[2] process id
--   ARGV[3] lease ttl ms  ARGV[4] total limit  ARGV[5] limit ceiling  ARGV[6] circuit cfg, then
--   for each task in KEYS order (carddata, card_status): its label, config limit, successes to
--   count (circuit_successes), how many idle slots it keeps, how many it gives back, then those
--   slot ids (kept first), then the fence length in ms. Gives back the latter, refreshes the expiry of the kept ones that still
--   exist (ZADD XX: a slot lost with a Redis flush is never re-created past the limits) and
--   decides per task whether the process may go on starting polls on kept slots without asking:
--   only while the task is not paused, its circuit is closed (or disabled) and not forced open,
--   neither set holds more than its limit (an override lowered meanwhile), no OTHER process
--   was refused a token in the last WAITER_MS, and no fence is on. Records the kept slots that still exist in
--   KEYS[12] under the process id (removes its entry when it keeps none), so that show can tell
--   idle kept slots from running polls. Returns per task {reuse 1|0, effective limit, invalid
--   override as stored ('' when none or valid), {kept ids that no longer exist}}.
-- show:    removes the expired leases of every set (counted in KEYS[11]) and the kept entries
--          past their expiry, then returns {leases total, leases carddata, leases card_status,
--          overrides flat [task, raw, ...], paused [task, ...], carddata circuit flat,
--          card_status circuit flat, carddata window, card_status window, now ms, expired so far
--          [total, carddata, card_status], kept [carddata, card_status]}. A task's kept count is
--          the slots that processes reported idle at their last renewal and that are still
--          leases of the task (a renewal is at most about a second old); the rest of the leases
--          are held by running polls.
-- circuit_force: ARGV[2] task index  ARGV[3] 'open'|'close'; returns circuit_force's answer.
-- reassert: ARGV[2] lease ttl ms, then pairs of task index and lease id: the leases of polls
--   still running in this process after Redis came back without them (an empty restart). Each is
--   added again to the total and its task's set with a full TTL, where it is missing (ZADD NX),
--   whatever the limits say: the poll is at the Gateway, so its tokens are in use. Returns how
--   many were added.
-- fence: ARGV[2] the fence length in ms, ARGV[3] the first-start mark: checks (and sets) the fence
--   as an acquire does, admitting nothing; a worker calls it as it starts, so that a new
--   deployment's fence hash exists before its first poll, however late that comes. Returns the
--   ms until the fence ends (0: none is on).
-- extend: ARGV[2] lease ttl ms, ARGV[3] task index, ARGV[4] lease id: a full TTL from now for a
--   lease that still exists (ZADD XX, in the total and its task's set): the lease of a call its
--   poll stopped waiting for, which counts until handler_timeout after it was sent, past the
--   expiry its acquire gave it. Returns 1 when the lease still existed.
--
-- The fence. Redis can lose the leases of polls that are still at the Gateway: a FLUSHALL, a
-- restart without its data, a restart from an append-only file that missed its last writes, a
-- failover to a replica that lagged. Every acquire and renew first compares the run_id of the
-- redis-server that answers (INFO server: a new one at every start) with the one stored in the
-- fence hash. When they differ, or the hash is missing, data may have been lost: the script sets
-- 'until' to TIME + the fence length (the caller's `Budget::fence_length`: long enough for every
-- poll admitted before to have left the Gateway) and stores the run_id, and until then no acquire
-- admits and no renew lets a process reuse its kept slots. The decision is Redis's, on Redis's
-- clock: no process has to notice the loss, write anything back or keep a timer. The one missing
-- hash that is not fenced is a deployment's first start: each process's acquires carry a
-- first-start mark until one is answered ('0' for a budget that was never told, or the
-- PostgreSQL time of the deployment's first start in ms, which must be less than half a fence
-- length ago), so pods started with a new deployment are not fenced, whichever acquires first.
local op = ARGV[1]

-- Checks the fence, and sets it when the data may have been lost (above). `length`: the fence
-- length in ms; `first`: the first-start mark or nil. Returns the ms until the fence ends (0:
-- none is on).
local function fence(length, first)
  local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or '?'
  local seen = redis.call('HMGET', KEYS[13], 'run_id', 'until')
  local now = clock()
  local till = tonumber(seen[2]) or 0
  if seen[1] ~= run_id then
    local first_start = false
    if not seen[1] and first and first ~= '' then
      local at = tonumber(first)
      first_start = at ~= nil and (at == 0 or now - at < length / 2)
    end
    if not first_start then till = math.max(till, now + length) end
    redis.call('HSET', KEYS[13], 'run_id', run_id, 'until', till)
  end
  if now < till then return till - now end
  return 0
end

-- A limit as `budget set` writes it: plain digits, 1..=ceiling. Anything else (garbage written
-- by hand, '0', '-3', '1e9', '2.5') is invalid and falls back to the config value.
local function valid_limit(raw, ceiling)
  if not raw or not string.match(raw, '^%d+$') then return nil end
  local n = tonumber(raw)
  if n < 1 or n > ceiling then return nil end
  return n
end

-- Removes one lease of task `index` from both sets; 1 when it existed.
local function release_lease(index, lease)
  local a = redis.call('ZREM', KEYS[1], lease)
  local b = redis.call('ZREM', KEYS[index], lease)
  if a + b > 0 then return 1 end
  return 0
end

-- Counts one finished poll's outcome in its task's circuit. Returns {existed, transition,
-- {numbers}} with `existed` as given.
local function record_one(index, existed, outcome, round, cfg, card)
  local answer = circuit_record(KEYS[index + 4], KEYS[index + 6], cfg, outcome, round, card)
  local numbers = {}
  for i = 2, #answer do numbers[#numbers + 1] = answer[i] end
  return {existed, answer[1], numbers}
end

-- How long a refused process counts as waiting for a token (twice a process's renewal period).
local WAITER_MS = 2000

-- The finishes a call carries: ARGV[at] of them, then 6 values each (task index, lease id,
-- outcome, probe round, card, successes before it). Each lease is released and its outcome
-- counted (after the successes the process added up since its last report), except the one at
-- position `keep` (1-based; nil for none), whose outcome is counted but whose lease is left for
-- the caller (an acquire taking it over); its answer's `existed` is filled in later. Returns
-- their answers in order.
local function carried_finishes(at, cfg, keep)
  local out = {}
  local count = tonumber(ARGV[at] or '0') or 0
  for i = 1, count do
    local b = at + 1 + (i - 1) * 6
    local index = tonumber(ARGV[b])
    local existed = 0
    if i ~= keep and ARGV[b + 1] ~= '' then existed = release_lease(index, ARGV[b + 1]) end
    circuit_successes(KEYS[index + 4], KEYS[index + 6], cfg, tonumber(ARGV[b + 5]) or 0)
    out[i] = record_one(index, existed, ARGV[b + 2], tonumber(ARGV[b + 3]), cfg, ARGV[b + 4])
  end
  return out
end

-- The scope label of lease set KEYS[index] (its field in the expired hash, KEYS[11]).
local SCOPES = {'total', 'carddata', 'card_status'}

-- Removes the expired leases of KEYS[index] (the TTL repair: a crashed or stalled holder's
-- leases stop counting once they expire) and counts them as ended by expiry. A lease its holder
-- released never reaches this; in a healthy fleet the count stays 0.
local function purge(index)
  local n = redis.call('ZREMRANGEBYSCORE', KEYS[index], '-inf', clock())
  if n > 0 then redis.call('HINCRBY', KEYS[11], SCOPES[index], n) end
end

-- Whether lease set KEYS[index] holds fewer than `limit` live leases. The TTL repair runs only
-- when the set looks full: an expired lease matters only then, so a healthy acquire pays one
-- ZCARD per set instead of a purge (the fleet gauges' `show` purges too, so an expired lease is
-- counted within a scrape or two even while nobody is short).
local function has_room(index, limit)
  if redis.call('ZCARD', KEYS[index]) < limit then return true end
  purge(index)
  return redis.call('ZCARD', KEYS[index]) < limit
end

-- Puts `member` in the set with `score`: re-scored in place when it is there (the usual case), or
-- added when it is not (it expired and was purged meanwhile). Either way it is in the set
-- afterwards, and the caller counts it as its own. Returns 1 when it was already there.
local function take_over(key, member, score)
  return 1 - redis.call('ZADD', key, score, member)
end

if op == 'acquire' then
  local index = tonumber(ARGV[2])
  local task_key = KEYS[index]
  local task, lease = ARGV[3], ARGV[4]
  local total_limit = tonumber(ARGV[5])
  local task_limit = tonumber(ARGV[6])
  local ceiling = tonumber(ARGV[7])
  local ttl = tonumber(ARGV[8])
  local circuit = KEYS[index + 4]
  local cfg = circuit_cfg(ARGV[9])

  -- Which carried finish's lease this acquire may take over: one of its own task (both sets
  -- re-scored), else the first (the total set re-scored).
  local keep
  local owner = ARGV[11]
  local count = tonumber(ARGV[12] or '0') or 0
  if ARGV[10] == '1' and count > 0 then
    -- An outcome without a lease (its call still counts at the Gateway) is never taken over.
    for i = 1, count do
      local b = 13 + (i - 1) * 6
      if ARGV[b + 1] ~= '' then
        if not keep then keep = i end
        if tonumber(ARGV[b]) == index then
          keep = i
          break
        end
      end
    end
  end
  -- The finishes this call carries are released first (all but the one kept), so that their
  -- slots count as free for this acquire, and their outcomes counted before the circuit admits.
  local finished = carried_finishes(12, cfg, keep)
  local keep_index, keep_lease
  if keep then
    local b = 13 + (keep - 1) * 6
    keep_index, keep_lease = tonumber(ARGV[b]), ARGV[b + 1]
  end
  -- Not admitted: the kept lease goes back as a plain finish's would.
  local function refuse(reason, limit, invalid, transition, wait)
    if keep then finished[keep][1] = release_lease(keep_index, keep_lease) end
    return {0, reason, limit, invalid, 0, transition, wait, finished, ''}
  end

  local invalid = ''
  local raw = redis.call('HGET', KEYS[4], task)
  if raw then
    local n = valid_limit(raw, ceiling)
    if n then task_limit = n else invalid = raw end
  end
  -- A task never gets more than the total, whatever the override says.
  if task_limit > total_limit then task_limit = total_limit end

  local tail = 13 + count * 6
  local fenced = fence(tonumber(ARGV[tail]) or 0, ARGV[tail + 1])
  if fenced > 0 then
    return refuse('fenced', task_limit, invalid, '', fenced)
  end
  if redis.call('SISMEMBER', KEYS[5], task) == 1 then
    return refuse('paused', task_limit, invalid, '', 0)
  end
  local verdict, detail, transition = circuit_admit(circuit, cfg)
  if verdict == 'open' then
    return refuse('circuit_open', task_limit, invalid, transition, detail)
  end

  local expiry = clock() + ttl
  -- The slot this poll would hold, and whether it already sits in each set (1: taken over, so
  -- the set's count includes it and the limit check counts it as this poll's).
  local slot, in_total, in_task = lease, 0, 0
  if keep then
    slot = keep_lease
    in_total = 1
    local was = take_over(KEYS[1], slot, expiry)
    if keep_index == index then
      in_task = 1
      was = math.max(was, take_over(task_key, slot, expiry))
    elseif redis.call('ZREM', KEYS[keep_index], slot) == 1 then
      was = 1
    end
    finished[keep][1] = was
  end
  local total_room = has_room(1, total_limit + in_total)
  local task_room = has_room(index, task_limit + in_task)
  if not (total_room and task_room) then
    if keep then
      if in_total == 1 then redis.call('ZREM', KEYS[1], slot) end
      if in_task == 1 then redis.call('ZREM', task_key, slot) end
    end
    -- The same lease again (a retry after a lost reply): it is already held, refresh it.
    if redis.call('ZSCORE', KEYS[1], lease) and redis.call('ZSCORE', task_key, lease) then
      redis.call('ZADD', KEYS[1], expiry, lease)
      redis.call('ZADD', task_key, expiry, lease)
      return {1, 'ok', task_limit, invalid, 0, transition, 0, finished, lease}
    end
    redis.call('ZADD', KEYS[10], clock() + WAITER_MS, owner)
    redis.call('PEXPIRE', KEYS[10], WAITER_MS)
    if not total_room then return {0, 'total', task_limit, invalid, 0, transition, 0, finished, ''} end
    return {0, 'task', task_limit, invalid, 0, transition, 0, finished, ''}
  end
  local round = 0
  if verdict == 'probe' then
    circuit_take_probe(circuit, ttl)
    round = detail
  end
  -- A retry of a granted lease with room to spare lands here too: ZADD refreshes it.
  if in_total == 0 then redis.call('ZADD', KEYS[1], expiry, slot) end
  if in_task == 0 then redis.call('ZADD', task_key, expiry, slot) end
  return {1, 'ok', task_limit, invalid, round, transition, 0, finished, slot}
elseif op == 'release' then
  local existed = 0
  for i = 2, #ARGV do
    local a = redis.call('ZREM', KEYS[1], ARGV[i])
    local b = redis.call('ZREM', KEYS[2], ARGV[i])
    local c = redis.call('ZREM', KEYS[3], ARGV[i])
    if a + b + c > 0 then existed = existed + 1 end
  end
  return existed
elseif op == 'fence' then
  return fence(tonumber(ARGV[2]) or 0, ARGV[3])
elseif op == 'extend' then
  local expiry = clock() + tonumber(ARGV[2])
  local index, lease = tonumber(ARGV[3]), ARGV[4]
  local a = redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, lease)
  redis.call('ZADD', KEYS[index], 'XX', expiry, lease)
  if a == 1 or redis.call('ZSCORE', KEYS[1], lease) then return 1 end
  return 0
elseif op == 'reassert' then
  local expiry = clock() + tonumber(ARGV[2])
  local added = 0
  for i = 3, #ARGV - 1, 2 do
    local index, lease = tonumber(ARGV[i]), ARGV[i + 1]
    added = added + redis.call('ZADD', KEYS[1], 'NX', expiry, lease)
    redis.call('ZADD', KEYS[index], 'NX', expiry, lease)
  end
  return added
elseif op == 'finish' then
  local index = tonumber(ARGV[2])
  local existed = release_lease(index, ARGV[3])
  return record_one(index, existed, ARGV[4], tonumber(ARGV[5]), circuit_cfg(ARGV[6]), ARGV[7])
elseif op == 'finish_batch' then
  return carried_finishes(3, circuit_cfg(ARGV[2]), nil)
elseif op == 'renew' then
  local owner, ttl = ARGV[2], tonumber(ARGV[3])
  local total_limit, ceiling = tonumber(ARGV[4]), tonumber(ARGV[5])
  local cfg = circuit_cfg(ARGV[6])
  -- Give back first, so that the counts below are the ones other processes see next.
  local tasks, at = {}, 7
  for index = 2, 3 do
    local t = {index = index, label = ARGV[at], limit = tonumber(ARGV[at + 1]), keep = {}, kept = {}}
    local successes, nkeep, nback = tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
    for i = 1, nkeep do t.keep[i] = ARGV[at + 4 + i] end
    if nback > 0 then
      local back = {}
      for i = 1, nback do back[i] = ARGV[at + 4 + nkeep + i] end
      redis.call('ZREM', KEYS[1], unpack(back))
      redis.call('ZREM', KEYS[index], unpack(back))
    end
    circuit_successes(KEYS[index + 4], KEYS[index + 6], cfg, successes)
    at = at + 5 + nkeep + nback
    tasks[#tasks + 1] = t
  end
  local fenced = fence(tonumber(ARGV[at]) or 0, nil) > 0
  local now = clock()
  local others_wait = false
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[10], '(' .. now, '+inf')) do
    if w ~= owner then
      others_wait = true
      break
    end
  end
  local paused = {}
  for _, p in ipairs(redis.call('SMEMBERS', KEYS[5])) do paused[p] = true end
  local overrides = redis.call('HMGET', KEYS[4], tasks[1].label, tasks[2].label)
  local total_fits = redis.call('ZCARD', KEYS[1]) <= total_limit
  local expiry = now + ttl
  local out = {}
  for i, t in ipairs(tasks) do
    local limit, invalid = t.limit, ''
    local raw = overrides[i]
    if raw then
      local n = valid_limit(raw, ceiling)
      if n then limit = n else invalid = raw end
    end
    if limit > total_limit then limit = total_limit end
    local reuse = total_fits and not others_wait and not paused[t.label] and not fenced
    if reuse then
      local st = circuit_read(KEYS[t.index + 4])
      reuse = st.forced ~= '1' and (not st.state or st.state == 'closed' or not cfg.enabled)
    end
    if reuse then reuse = redis.call('ZCARD', KEYS[t.index]) <= limit end
    local lost = {}
    if #t.keep > 0 then
      local scores = redis.call('ZMSCORE', KEYS[1], unpack(t.keep))
      local live = {}
      for j, id in ipairs(t.keep) do
        if scores[j] then
          live[#live + 1] = expiry
          live[#live + 1] = id
        else
          lost[#lost + 1] = id
        end
      end
      if #live > 0 then
        redis.call('ZADD', KEYS[1], 'XX', unpack(live))
        redis.call('ZADD', KEYS[t.index], 'XX', unpack(live))
        for j = 2, #live, 2 do t.kept[#t.kept + 1] = live[j] end
      end
      if #lost > 0 then redis.call('ZREM', KEYS[t.index], unpack(lost)) end
    end
    local r = 0
    if reuse then r = 1 end
    out[i] = {r, limit, invalid, lost}
  end
  if #tasks[1].kept + #tasks[2].kept > 0 then
    redis.call('HSET', KEYS[12], owner, expiry .. '|' .. table.concat(tasks[1].kept, ' ') .. '|'
      .. table.concat(tasks[2].kept, ' '))
  else
    redis.call('HDEL', KEYS[12], owner)
  end
  return out
elseif op == 'circuit_force' then
  local index = tonumber(ARGV[2])
  return circuit_force(KEYS[index + 4], KEYS[index + 6], ARGV[3])
elseif op == 'show' then
  local now = clock()
  for index = 1, 3 do purge(index) end
  -- Idle kept slots per task: those of each live entry that are still leases of the task.
  local kept = {0, 0}
  local entries = redis.call('HGETALL', KEYS[12])
  for i = 1, #entries, 2 do
    local expiry, data, status = string.match(entries[i + 1], '^(%d+)|([^|]*)|([^|]*)$')
    if not expiry or tonumber(expiry) <= now then
      redis.call('HDEL', KEYS[12], entries[i])
    else
      for j, ids in ipairs({data, status}) do
        local list = {}
        for id in string.gmatch(ids, '%S+') do list[#list + 1] = id end
        if #list > 0 then
          for _, score in ipairs(redis.call('ZMSCORE', KEYS[j + 1], unpack(list))) do
            if score then kept[j] = kept[j] + 1 end
          end
        end
      end
    end
  end
  return {
    redis.call('ZCARD', KEYS[1]),
    redis.call('ZCARD', KEYS[2]),
    redis.call('ZCARD', KEYS[3]),
    redis.call('HGETALL', KEYS[4]),
    redis.call('SMEMBERS', KEYS[5]),
    redis.call('HGETALL', KEYS[6]),
    redis.call('HGETALL', KEYS[7]),
    redis.call('LRANGE', KEYS[8], 0, -1),
    redis.call('LRANGE', KEYS[9], 0, -1),
    now,
    redis.call('HMGET', KEYS[11], SCOPES[1], SCOPES[2], SCOPES[3]),
    kept,
  }
end
return redis.error_reply('unknown budget op ' .. tostring(op))
