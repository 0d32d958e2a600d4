-- Polling chains: at most one live chain per card and task.
-- KEYS[1] chain hash (card_ref -> "chain_id|due_ms")   KEYS[2] intake zset   KEYS[3] intake payload hash
-- ARGV[1] op: start | start_if_dead | schedule | check | finish
-- ARGV[2] card_ref  ARGV[3] chain id (job's, or the new one for start*)
-- ARGV[4] delay ms  ARGV[5] payload JSON (start*/schedule)  ARGV[6] grace ms (start_if_dead)
-- Returns: start*: 1 started / 0 left alone; schedule: 1 / 0 stale; check: {state, chain id}
--          with state 'live' | 'stale' | 'adopted'; finish: 1 / 0 stale.
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

local function put(id, delay, payload)
  local due = now + tonumber(delay)
  redis.call('HSET', KEYS[1], card, id .. '|' .. due)
  redis.call('HSET', KEYS[3], card, payload)
  redis.call('ZADD', KEYS[2], due, card)
end

if op == 'start' then
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'start_if_dead' then
  if cur_id and cur_due and cur_due + tonumber(ARGV[6]) > now then
    return 0
  end
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'schedule' then
  if cur_id ~= chain then return 0 end
  put(chain, ARGV[4], ARGV[5])
  return 1
elseif op == 'check' then
  if not cur_id then
    -- The chain state was lost (Redis flushed, or a producer enqueued without a chain): adopt
    -- the job. Worst case one extra poll if reconcile also restarted the card.
    local id = chain
    if id == '' then id = ARGV[4] end
    redis.call('HSET', KEYS[1], card, id .. '|' .. now)
    return {'adopted', id}
  elseif cur_id == chain then
    return {'live', chain}
  else
    return {'stale', cur_id}
  end
elseif op == 'finish' then
  if cur_id ~= chain then return 0 end
  redis.call('HDEL', KEYS[1], card)
  return 1
end
return redis.error_reply('unknown chain op ' .. tostring(op))
