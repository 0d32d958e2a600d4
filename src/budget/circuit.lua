-- The fleet-wide Gateway circuit breaker of each polling task: functions only. This text is
-- PREPENDED to budget.lua (see budget/circuit.rs), so that admitting a poll (tokens AND a closed
-- circuit) is one script call, and counting its outcome rides on the lease release: the breaker
-- adds no round trip to a poll.
--
-- Per task, under the budget's hash tag:
--   circuit hash: state ('closed' when absent | 'open' | 'half_open'), fails (failures in the
--     window list), until (ms: end of the cool-down), cooldown (ms: the current cool-down),
--     since (ms: the outage began), round (half-open round), probes (probes admitted in this
--     round), probe_until (ms: when admitted probes that never reported stop holding a slot),
--     forced ('1' while an operator forced it open), open_calls / open_fails (the window when it
--     opened), reopens (failed probe rounds in this outage).
--   window list: the latest outcomes, newest first, each 'f<ms>:<card_ref>' (a failure, with its
--     card) or 's<ms>' (a success), at most cfg.calls of them. While the window holds no
--     failure, successes are not pushed (nothing to dilute): a healthy fleet pays one HMGET per
--     task and script call (an acquire that carries a finish of its own task reads it once).
-- All times are Redis TIME in ms, read at most once per script call and only when needed
-- (clock()): a healthy poll's finish and a closed circuit's admission need no clock.
--
-- Each circuit hash is read at most once per script call (circuit_read, one HMGET of every field)
-- and the copy is dropped whenever the call writes the hash (circuit_changed), so that an acquire
-- that carries its own task's finish reads the circuit once, not twice.

local now_ms
local function clock()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end

local CIRCUIT_FIELDS = {'state', 'fails', 'until', 'round', 'probes', 'probe_until', 'forced',
  'cooldown', 'since', 'reopens', 'open_calls', 'open_fails'}
local circuit_cache = {}

-- The circuit hash as a table of its fields (absent ones nil), read once per call.
local function circuit_read(hash)
  local c = circuit_cache[hash]
  if not c then
    local raw = redis.call('HMGET', hash, unpack(CIRCUIT_FIELDS))
    c = {}
    for i, name in ipairs(CIRCUIT_FIELDS) do
      if raw[i] then c[name] = raw[i] end
    end
    circuit_cache[hash] = c
  end
  return c
end

-- Forgets the copy after a write, so that the next read in the same call sees the write.
local function circuit_changed(hash)
  circuit_cache[hash] = nil
end

-- cfg: 'enabled,calls,window_ms,min_calls,min_cards,percent,cooldown_ms,max_cooldown_ms,probes'
local function circuit_cfg(packed)
  local v = {}
  for n in string.gmatch(packed, '[^,]+') do v[#v + 1] = tonumber(n) end
  return {
    enabled = v[1] == 1, calls = v[2], window_ms = v[3], min_calls = v[4], min_cards = v[5],
    percent = v[6], cooldown_ms = v[7], max_cooldown_ms = v[8], probes = v[9],
  }
end

-- Whether a poll may call the Gateway. Returns verdict, detail, transition:
--   'pass', 0           closed (or breaker disabled and not forced)
--   'probe', round      half-open and a probe slot is free: the caller takes it with
--                       circuit_take_probe once the tokens are granted
--   'open', wait_ms     no call; wait_ms until the cool-down ends (0 when unknown: forced, or
--                       every probe slot taken)
-- transition is 'half_open' when this call ended the cool-down, else ''.
local function circuit_admit(hash, cfg)
  local st = circuit_read(hash)
  local state = st.state
  if st.forced == '1' then return 'open', 0, '' end
  if not state or state == 'closed' or not cfg.enabled then return 'pass', 0, '' end
  local now = clock()
  local transition = ''
  local round = tonumber(st.round) or 0
  local probes = tonumber(st.probes) or 0
  if state == 'open' then
    local untl = tonumber(st['until']) or 0
    if now < untl then return 'open', untl - now, '' end
    round = round + 1
    probes = 0
    redis.call('HSET', hash, 'state', 'half_open', 'round', round, 'probes', 0)
    circuit_changed(hash)
    transition = 'half_open'
  elseif probes >= cfg.probes and now >= (tonumber(st.probe_until) or 0) then
    -- Every probe of this round was admitted and none reported within a lease: their pods died.
    -- Free the slots so that the circuit can still close.
    probes = 0
    redis.call('HSET', hash, 'probes', 0)
    circuit_changed(hash)
  end
  if probes >= cfg.probes then return 'open', 0, transition end
  return 'probe', round, transition
end

-- Takes one probe slot of the current round (after the tokens were granted).
local function circuit_take_probe(hash, ttl_ms)
  redis.call('HINCRBY', hash, 'probes', 1)
  redis.call('HSET', hash, 'probe_until', clock() + ttl_ms)
  circuit_changed(hash)
end

-- Counts the outcome of one poll ('ok' | 'fail' | 'none' = no Gateway call) about `card` and
-- moves the circuit. round > 0: the poll was a probe of that half-open round. Returns a
-- transition:
--   {''} nothing changed state
--   {'opened', counted calls, failed calls}
--   {'reopened', new cool-down ms}
--   {'closed', outage duration ms, failed probe rounds, calls when opened, failures when opened}
local function circuit_record(hash, list, cfg, outcome, round, card)
  -- Outcomes of polls admitted while closed count only while enabled, and a poll that made no
  -- Gateway call says nothing: neither needs the hash.
  if round == 0 and (outcome == 'none' or not cfg.enabled) then return {''} end
  local st = circuit_read(hash)
  local state = st.state or 'closed'
  if round > 0 then
    -- A probe's verdict counts only in its own round, while half-open and not forced.
    if state ~= 'half_open' or tonumber(st.round) ~= round or st.forced == '1' then return {''} end
    circuit_changed(hash)
    if outcome == 'none' then
      -- It made no Gateway call (stale job, parked card, ...): give its slot to another poll.
      if redis.call('HINCRBY', hash, 'probes', -1) < 0 then redis.call('HSET', hash, 'probes', 0) end
      return {''}
    end
    local now = clock()
    if outcome == 'ok' then
      local since = tonumber(st.since) or now
      redis.call('DEL', list)
      redis.call('HDEL', hash, 'until', 'cooldown', 'since', 'probes', 'probe_until', 'reopens',
        'open_calls', 'open_fails')
      redis.call('HSET', hash, 'state', 'closed', 'fails', 0)
      return {'closed', now - since, tonumber(st.reopens) or 0, tonumber(st.open_calls) or 0,
        tonumber(st.open_fails) or 0}
    end
    local cd = (tonumber(st.cooldown) or cfg.cooldown_ms) * 2
    if cd > cfg.max_cooldown_ms then cd = cfg.max_cooldown_ms end
    redis.call('HSET', hash, 'state', 'open', 'until', now + cd, 'cooldown', cd, 'probes', 0)
    redis.call('HINCRBY', hash, 'reopens', 1)
    return {'reopened', cd}
  end
  -- Outcomes of polls admitted while closed; late ones (the circuit opened meanwhile) are the
  -- outage's, already counted.
  if state ~= 'closed' then return {''} end
  local fails = tonumber(st.fails) or 0
  if outcome == 'ok' and fails == 0 then return {''} end
  circuit_changed(hash)
  local now = clock()
  local failed_now = outcome == 'fail'
  local entry = 's' .. now
  if failed_now then entry = 'f' .. now .. ':' .. card end
  local len = redis.call('LPUSH', list, entry)
  local before = fails
  if len == 1 then fails = 0 end
  if failed_now then fails = fails + 1 end
  if len > cfg.calls then
    local old = redis.call('RPOP', list)
    if old and string.sub(old, 1, 1) == 'f' then fails = fails - 1 end
  end
  if fails < 0 then fails = 0 end
  -- The failures in the list are a cheap necessary condition; the time-bounded count decides.
  local need = math.ceil(cfg.min_calls * cfg.percent / 100)
  if not failed_now or fails < need then
    if fails ~= before then redis.call('HSET', hash, 'fails', fails) end
    return {''}
  end
  local oldest = now - cfg.window_ms
  local recent, failed, all_failed, cards, distinct = 0, 0, 0, {}, 0
  for _, e in ipairs(redis.call('LRANGE', list, 0, -1)) do
    local is_f = string.sub(e, 1, 1) == 'f'
    if is_f then all_failed = all_failed + 1 end
    if (tonumber(string.match(e, '^.(%d+)')) or 0) >= oldest then
      recent = recent + 1
      if is_f then
        failed = failed + 1
        local c = string.match(e, ':(.*)$') or ''
        if not cards[c] then
          cards[c] = true
          distinct = distinct + 1
        end
      end
    end
  end
  if recent < cfg.min_calls or failed * 100 < cfg.percent * recent
      or distinct < cfg.min_cards then
    -- Re-counted from the list itself, so a drifted counter heals here.
    redis.call('HSET', hash, 'fails', all_failed)
    return {''}
  end
  redis.call('HSET', hash, 'state', 'open', 'fails', all_failed, 'until', now + cfg.cooldown_ms,
    'cooldown', cfg.cooldown_ms, 'since', now, 'open_calls', recent, 'open_fails', failed,
    'reopens', 0, 'probes', 0)
  return {'opened', recent, failed}
end

-- Counts `n` successful outcomes that a process did not report one by one: polls that ran on a
-- slot it kept between polls (budget/pool.rs) and whose answers it added up. They arrive with the
-- process's next failure of the task (before it, so that the window keeps them in about their
-- order) or with its next renewal. As for a single success: nothing to do while the window holds
-- no failure, or when the circuit is not closed (late outcomes of an outage are already counted).
-- At most window-calls of them are pushed, in chunks that Lua's unpack can take.
local function circuit_successes(hash, list, cfg, n)
  if n <= 0 or not cfg.enabled then return end
  local st = circuit_read(hash)
  if (st.state or 'closed') ~= 'closed' or st.forced == '1' then return end
  local fails = tonumber(st.fails) or 0
  if fails == 0 then return end
  if n > cfg.calls then n = cfg.calls end
  circuit_changed(hash)
  local entry = 's' .. clock()
  local len = 0
  local left = n
  while left > 0 do
    local chunk = math.min(left, 500)
    local batch = {}
    for i = 1, chunk do batch[i] = entry end
    len = redis.call('LPUSH', list, unpack(batch))
    left = left - chunk
  end
  -- Only our own entries: the failures it counted are gone (the list had expired or was cleared).
  if len == n then fails = 0 end
  if len > cfg.calls then
    for _, old in ipairs(redis.call('RPOP', list, len - cfg.calls)) do
      if string.sub(old, 1, 1) == 'f' then fails = fails - 1 end
    end
  end
  if fails < 0 then fails = 0 end
  redis.call('HSET', hash, 'fails', fails)
end

-- An operator forces the circuit: 'open' (stays open, no probes, until forced closed) or
-- 'close' (closed now, window cleared). Returns {state before, ms since the outage began (0 when
-- it was closed), '1' when it had been forced open}.
local function circuit_force(hash, list, how)
  local st = circuit_read(hash)
  circuit_changed(hash)
  local now = clock()
  local before = st.state or 'closed'
  local since = tonumber(st.since)
  local was_forced = st.forced or ''
  local dur = 0
  if since and before ~= 'closed' then dur = now - since end
  if how == 'open' then
    if before == 'closed' or not since then since = now end
    redis.call('HSET', hash, 'state', 'open', 'forced', '1', 'since', since, 'until', 0,
      'probes', 0)
  else
    redis.call('DEL', list)
    redis.call('DEL', hash)
    redis.call('HSET', hash, 'state', 'closed', 'fails', 0)
  end
  return {before, dur, was_forced}
end
