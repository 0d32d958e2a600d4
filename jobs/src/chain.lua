-- Polling chains: at most one live chain per card and task. The one script every chain write goes
-- through: the worker (start, schedule, check, finish, reconcile) and the producer API (merge).
-- KEYS[1] chain hash (card_ref -> "chain_id|due_ms")   KEYS[2] intake zset   KEYS[3] intake payload hash
-- KEYS[4] due index zset (card_ref -> due_ms of its chain: reconcile finds overdue chains in it)
-- ARGV[1] op: start | start_if_dead | drop_if_dead | schedule | check | finish | merge
-- ARGV[2] card_ref  ARGV[3] chain id (job's; the new one for start*/merge)
-- ARGV[4] delay ms (start*/schedule/merge), or a fresh id (check)
-- ARGV[5] payload JSON (start*/schedule/merge)
-- ARGV[6] grace ms (start_if_dead, drop_if_dead), or how long a chain without a waiting entry counts as
--         live past its due time (merge)
-- Returns: start*, drop_if_dead: 1 done / 0 left alone (live); schedule: 1 / 0 stale; check: {state, chain id}
--          with state 'live' | 'stale' | 'adopted'; finish: 1 / 0 stale;
--          merge: {'merged' | 'started', chain id}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, card, chain = ARGV[1], ARGV[2], ARGV[3]
local cur = redis.call('HGET', KEYS[1], card)
local cur_id, cur_due = nil, nil
if cur then
  local sep = string.find(cur, '|', 1, true)
  if sep then
    cur_id = string.sub(cur, 1, sep - 1)
    cur_due = tonumber(string.sub(cur, sep + 1))
  else
    cur_id = cur
  end
end

local function mark(id, due)
  redis.call('HSET', KEYS[1], card, id .. '|' .. due)
  redis.call('ZADD', KEYS[4], due, card)
end

-- Lowers the intakes' due hint (`{prefix}:intakes:due`, keys::intake_due_hint) to an entry's due
-- time, so that the feeder looks at this intake by then (issue 16). Its name is made from the
-- intake key's prefix, as the queue scripts make apalis's meta keys, so that no caller passes it.
local function hint(due)
  local prefix = string.match(KEYS[2], '^(.*):intake:[^:]*$')
  if prefix then redis.call('ZADD', prefix .. ':intakes:due', 'LT', due, KEYS[2]) end
end

local function put(id, delay, payload)
  local due = now + tonumber(delay)
  mark(id, due)
  redis.call('HSET', KEYS[3], card, payload)
  redis.call('ZADD', KEYS[2], due, card)
  hint(due)
end

if op == 'start' then
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'start_if_dead' then
  if cur_id and cur_due and cur_due + tonumber(ARGV[6]) > now then
    -- Live: keep the index in step with the hash (reconcile reads the index).
    redis.call('ZADD', KEYS[4], cur_due, card)
    return 0
  end
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'drop_if_dead' then
  -- Reconcile found an overdue chain of a card that needs no polling any more.
  if cur_id and cur_due and cur_due + tonumber(ARGV[6]) > now then
    redis.call('ZADD', KEYS[4], cur_due, card)
    return 0
  end
  redis.call('HDEL', KEYS[1], card)
  redis.call('ZREM', KEYS[4], card)
  return 1
elseif op == 'schedule' then
  -- A chain whose entry is gone (Redis lost it while the job ran) is adopted by its job: the
  -- successor is written, so the card is never left without one.
  if cur_id and cur_id ~= chain then return 0 end
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'check' then
  if not cur_id then
    -- The chain state was lost (Redis flushed, or a legacy producer enqueued without a chain):
    -- adopt the job. Worst case one extra poll if reconcile also restarted the card.
    local id = chain
    if id == '' then id = ARGV[4] end
    mark(id, now)
    return {'adopted', id}
  elseif cur_id == chain then
    return {'live', chain}
  elseif chain == '' and not redis.call('ZSCORE', KEYS[2], card) then
    -- A chain-less job (written raw, or by a producer from before the merge) that took the
    -- place of the chain's own waiting entry: it joins the chain instead of ending it.
    mark(cur_id, now)
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
        mark(cur_id, due)
      end
      return {'merged', cur_id}
    end
    -- Nothing waits: the chain's job is being fed or run, unless the chain is long overdue.
    if cur_due and cur_due + tonumber(ARGV[6]) > now then
      return {'merged', cur_id}
    end
  end
  put(chain, ARGV[4], ARGV[5])
  return {'started', chain}
end
return redis.error_reply('unknown chain op ' .. tostring(op))
