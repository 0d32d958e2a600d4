-- The polling budget: leases in sorted sets scored by expiry (unix ms on the REDIS clock).
-- Every key shares the hash tag {budget}, so the script stays valid on Redis Cluster.
--
-- KEYS[1] total lease zset   KEYS[2] carddata lease zset   KEYS[3] card_status lease zset
-- KEYS[4] overrides hash (task -> limit)   KEYS[5] paused set (task labels)
-- ARGV[1] op: acquire | release | show
--
-- acquire: ARGV[2] task index (2 = carddata, 3 = card_status, i.e. its KEYS index)
--          ARGV[3] task label  ARGV[4] lease id  ARGV[5] total limit  ARGV[6] config task limit
--          ARGV[7] limit ceiling  ARGV[8] lease ttl ms
--   returns {granted 1|0, reason 'ok'|'total'|'task'|'paused', effective task limit,
--            invalid override as stored ('' when none or valid)}
-- release: ARGV[2..] lease ids; removes each from every set. Returns how many leases existed.
-- show:    returns {in_use total, in_use carddata, in_use card_status, overrides flat
--          [task, raw, ...], paused [task, ...]}; counts only unexpired leases.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]

-- A limit as `budget set` writes it: plain digits, 1..=ceiling. Anything else (garbage written
-- by hand, '0', '-3', '1e9', '2.5') is invalid and falls back to the config value.
local function valid_limit(raw, ceiling)
  if not raw or not string.match(raw, '^%d+$') then return nil end
  local n = tonumber(raw)
  if n < 1 or n > ceiling then return nil end
  return n
end

if op == 'acquire' then
  local task_key = KEYS[tonumber(ARGV[2])]
  local task, lease = ARGV[3], ARGV[4]
  local total_limit = tonumber(ARGV[5])
  local task_limit = tonumber(ARGV[6])
  local ceiling = tonumber(ARGV[7])
  local expiry = now + tonumber(ARGV[8])

  -- TTL repair: a crashed worker's leases stop counting once they expire, in both sets.
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', task_key, '-inf', now)

  local invalid = ''
  local raw = redis.call('HGET', KEYS[4], task)
  if raw then
    local n = valid_limit(raw, ceiling)
    if n then task_limit = n else invalid = raw end
  end
  -- A task never gets more than the total, whatever the override says.
  if task_limit > total_limit then task_limit = total_limit end

  if redis.call('SISMEMBER', KEYS[5], task) == 1 then
    return {0, 'paused', task_limit, invalid}
  end
  -- The same lease again (a retry after a lost reply): it is already held, refresh it.
  if redis.call('ZSCORE', KEYS[1], lease) and redis.call('ZSCORE', task_key, lease) then
    redis.call('ZADD', KEYS[1], expiry, lease)
    redis.call('ZADD', task_key, expiry, lease)
    return {1, 'ok', task_limit, invalid}
  end
  local total_short = redis.call('ZCARD', KEYS[1]) >= total_limit
  local task_short = redis.call('ZCARD', task_key) >= task_limit
  if total_short then return {0, 'total', task_limit, invalid} end
  if task_short then return {0, 'task', task_limit, invalid} end
  redis.call('ZADD', KEYS[1], expiry, lease)
  redis.call('ZADD', task_key, expiry, lease)
  return {1, 'ok', task_limit, invalid}
elseif op == 'release' then
  local existed = 0
  for i = 2, #ARGV do
    local a = redis.call('ZREM', KEYS[1], ARGV[i])
    local b = redis.call('ZREM', KEYS[2], ARGV[i])
    local c = redis.call('ZREM', KEYS[3], ARGV[i])
    if a + b + c > 0 then existed = existed + 1 end
  end
  return existed
elseif op == 'show' then
  local live = '(' .. now
  return {
    redis.call('ZCOUNT', KEYS[1], live, '+inf'),
    redis.call('ZCOUNT', KEYS[2], live, '+inf'),
    redis.call('ZCOUNT', KEYS[3], live, '+inf'),
    redis.call('HGETALL', KEYS[4]),
    redis.call('SMEMBERS', KEYS[5]),
  }
end
return redis.error_reply('unknown budget op ' .. tostring(op))
