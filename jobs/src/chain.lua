-- Polling chains: at most one live chain per card and task. The one script every chain write goes
-- through: the worker (start, schedule, check, finish, reconcile) and the producer API (merge).
-- KEYS[1] chain hash (card_ref -> "chain_id|unchanged|last|since", see below)   KEYS[2] intake zset
-- KEYS[3] intake payload hash
-- KEYS[4] due index zset (card_ref -> due_ms of its chain: reconcile finds overdue chains in it)
-- KEYS[5] (schedule with tally 'u' only) the fleet-wide counter of unchanged polls of this task and
--         hour: INCR, and its expiry set by the increment that creates it
-- ARGV[1] op: start | start_if_dead | drop_if_dead | schedule | check | finish | merge
-- ARGV[2] card_ref  ARGV[3] chain id (job's; the new one for start*/merge)
-- ARGV[4] delay ms (start*/schedule/merge), or a fresh id (check)
-- ARGV[5] payload JSON (start*/schedule/merge)
-- ARGV[6] grace ms (start_if_dead, drop_if_dead), or how long a chain without a waiting entry counts as
--         live past its due time (merge), or the tally (schedule): 'u' one more unchanged poll,
--         'r' reset by a recorded change or failure, anything else keeps it
-- ARGV[7] (schedule with tally 'u') expiry of the hourly counter, seconds
-- Returns: start*, drop_if_dead: 1 done / 0 left alone (live); schedule: 1 / 0 stale; check: {state, chain id}
--          with state 'live' | 'stale' | 'adopted'; finish: 1 / 0 stale;
--          merge: {'merged' | 'started', chain id}.
--
-- The chain entry's tally (issue 19: the unchanged-poll facts live with the chain, so they cost no
-- key of their own and go when the chain goes): `unchanged` polls counted since `since`, the time
-- of the `last` one (base-36 unix seconds, '0' for none), and `since` as a kind letter plus base-36
-- unix seconds: 'c' the chain's last recorded change or failure, 's' the chain's start (a first
-- start, `enqueue`, reconcile, an adoption after Redis lost its data): nothing before it is known.
-- An entry written before the tally (`chain_id|due_ms`) still parses; it gains a tally ('s', now)
-- at its next write. The due time lives in the due index only (ZSCORE, off the hot path).
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, card, chain = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('HGET', KEYS[1], card)
local cur_id, legacy_due, cur_tally = nil, nil, nil
if cur then
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

local function fresh()
  return {0, '0', 's' .. b36(now_s)}
end

-- The due time of the card's current chain (nil when unknown: counts as dead).
local function cur_due()
  local s = redis.call('ZSCORE', KEYS[4], card)
  if s then return tonumber(s) end
  return legacy_due
end

local function mark(id, due, tally)
  redis.call('HSET', KEYS[1], card, id .. '|' .. tally[1] .. '|' .. tally[2] .. '|' .. tally[3])
  redis.call('ZADD', KEYS[4], due, card)
end

-- Lowers the intakes' due hint (`{prefix}:intakes:due`, keys::intake_due_hint) to an entry's due
-- time, so that the feeder looks at this intake by then (issue 16). Its name is made from the
-- intake key's prefix, as the queue scripts make apalis's meta keys, so that no caller passes it.
local function hint(due)
  local prefix = string.match(KEYS[2], '^(.*):intake:[^:]*$')
  if prefix and redis.call('ZADD', prefix .. ':intakes:due', 'LT', 'CH', due, KEYS[2]) == 1 then
    -- Lowered: announce it, so that a feeder sleeping until a later time feeds it in time.
    redis.call('PUBLISH', prefix .. ':intakes:wake', due)
  end
end

local function put(id, delay, payload, tally)
  local due = now + tonumber(delay)
  mark(id, due, tally)
  redis.call('HSET', KEYS[3], card, payload)
  redis.call('ZADD', KEYS[2], due, card)
  hint(due)
end

if op == 'start' then
  put(chain, ARGV[4], ARGV[5], fresh())
  return 1
elseif op == 'start_if_dead' then
  local due = cur_id and cur_due()
  if due and due + tonumber(ARGV[6]) > now then
    -- Live: keep the index in step with the hash (reconcile reads the index).
    redis.call('ZADD', KEYS[4], due, card)
    return 0
  end
  put(chain, ARGV[4], ARGV[5], fresh())
  return 1
elseif op == 'drop_if_dead' then
  -- Reconcile found an overdue chain of a card that needs no polling any more.
  local due = cur_id and cur_due()
  if due and due + tonumber(ARGV[6]) > now then
    redis.call('ZADD', KEYS[4], due, card)
    return 0
  end
  redis.call('HDEL', KEYS[1], card)
  redis.call('ZREM', KEYS[4], card)
  return 1
elseif op == 'schedule' then
  -- A chain whose entry is gone (Redis lost it while the job ran) is adopted by its job: the
  -- successor is written, so the card is never left without one.
  if cur_id and cur_id ~= chain then return 0 end
  local tally = cur_tally or fresh()
  local mode = ARGV[6]
  if mode == 'u' then
    tally[1] = tally[1] + 1
    tally[2] = b36(now_s)
    if KEYS[5] and redis.call('INCR', KEYS[5]) == 1 then
      redis.call('EXPIRE', KEYS[5], tonumber(ARGV[7]))
    end
  elseif mode == 'r' then
    tally[1] = 0
    tally[3] = 'c' .. b36(now_s)
  end
  put(chain, ARGV[4], ARGV[5], tally)
  return 1
elseif op == 'check' then
  if not cur_id then
    -- The chain state was lost (Redis flushed, or a legacy producer enqueued without a chain):
    -- adopt the job. Worst case one extra poll if reconcile also restarted the card.
    local id = chain
    if id == '' then id = ARGV[4] end
    mark(id, now, fresh())
    return {'adopted', id}
  elseif cur_id == chain then
    return {'live', chain}
  elseif chain == '' and not redis.call('ZSCORE', KEYS[2], card) then
    -- A chain-less job (written raw, or by a producer from before the merge) that took the
    -- place of the chain's own waiting entry: it joins the chain instead of ending it.
    mark(cur_id, now, cur_tally or fresh())
    return {'adopted', cur_id}
  else
    return {'stale', cur_id}
  end
elseif op == 'finish' then
  if cur_id and cur_id ~= chain then return 0 end
  redis.call('HDEL', KEYS[1], card)
  redis.call('ZREM', KEYS[4], card)
  return 1
elseif op == 'merge' then
  -- A producer asks for a poll of a card. A live chain keeps its own job (with its failure count
  -- and deferrals); its waiting poll is only brought forward. Without a live chain, a new one
  -- starts with the producer's job.
  local due = now + tonumber(ARGV[4])
  if cur_id then
    local waiting = redis.call('ZSCORE', KEYS[2], card)
    if waiting then
      if tonumber(waiting) > due then
        redis.call('ZADD', KEYS[2], due, card)
        hint(due)
        mark(cur_id, due, cur_tally or fresh())
      end
      return {'merged', cur_id}
    end
    -- Nothing waits: the chain's job is being fed or run, unless the chain is long overdue.
    local was_due = cur_due()
    if was_due and was_due + tonumber(ARGV[6]) > now then
      return {'merged', cur_id}
    end
  end
  put(chain, ARGV[4], ARGV[5], fresh())
  return {'started', chain}
end
return redis.error_reply('unknown chain op ' .. tostring(op))
