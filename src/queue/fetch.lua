-- A worker's fetch: apalis-redis 1.0.0's `fetch_next.lua` without the per-job meta
-- hash. apalis reads every fetched job's meta hash (`HGETALL`) for its attempt count and status;
-- cardworker never retries through apalis (re-runs go through the intake), so every job starts at
-- attempt 0 and the meta hash is not read. Same keys and layout as apalis's fetch: an older
-- release's workers and this one's share a queue during a rolling deploy.
--
-- Two differences besides the meta hash:
-- - scheduled jobs are promoted at most 1,000 per fetch (apalis promotes all of them with one
--   `unpack`, which fails above about 8,000: the cliff the intake's high-water mark keeps away);
-- - an id whose data is gone (trimmed, or removed by hand) is dropped from the inflight set and
--   answered as nil: apalis fails the whole fetch on it, which stops the worker.
--
-- KEYS[1] Q:workers  KEYS[2] Q:active  KEYS[3] this worker's inflight set  KEYS[4] Q:data
-- KEYS[5] Q:signal   KEYS[6] Q:scheduled
-- ARGV[1] now (unix seconds)  ARGV[2] most jobs to fetch  ARGV[3] the worker's name
-- Returns {ids, data}: data[i] is job ids[i]'s payload, or nil when it was gone.
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  -- The text the supervisor and apalis's own fetch use: the worker was dropped (Redis lost its
  -- data, or a peer's orphan recovery declared it dead); the supervisor builds it again.
  return redis.error_reply("Cant fetch next: worker not registered")
end

local due = redis.call('ZRANGEBYSCORE', KEYS[6], 0, ARGV[1], 'LIMIT', 0, 1000)
if #due > 0 then
  redis.call('RPUSH', KEYS[2], unpack(due))
  redis.call('ZREM', KEYS[6], unpack(due))
end

local n = tonumber(ARGV[2])
local ids = redis.call('LRANGE', KEYS[2], 0, n - 1)
if #ids < n then redis.call('DEL', KEYS[5]) end
if #ids == 0 then return {{}, {}} end

redis.call('SADD', KEYS[3], unpack(ids))
redis.call('LTRIM', KEYS[2], #ids, -1)
local data = redis.call('HMGET', KEYS[4], unpack(ids))
local gone = {}
for i = 1, #ids do
  if not data[i] then gone[#gone + 1] = ids[i] end
end
if #gone > 0 then redis.call('SREM', KEYS[3], unpack(gone)) end
return {ids, data}
