-- Trims the bookkeeping apalis-redis 1.0.0 keeps for finished jobs (about 700 bytes each, forever
-- otherwise): done jobs at once, dead jobs once they are older than the retention period, so that
-- failures stay inspectable for a while.
--
-- KEYS[1] Q:done  KEYS[2] Q:dead  KEYS[3] Q:data  KEYS[4] Q:meta (prefix)
-- ARGV[1] max done ids to trim; ARGV[2] dead retention (s); ARGV[3] SSCAN cursor over Q:dead;
-- ARGV[4] dead ids to examine
-- Returns {done trimmed, dead trimmed, next dead cursor}
-- Done jobs: one DEL and one HDEL for the whole batch, not two commands per job.
local done = redis.call('SPOP', KEYS[1], tonumber(ARGV[1]))
if #done > 0 then
  local metas = {}
  for i, id in ipairs(done) do metas[i] = KEYS[4] .. ':' .. id end
  redis.call('DEL', unpack(metas))
  redis.call('HDEL', KEYS[3], unpack(done))
end
local now = tonumber(redis.call('TIME')[1])
local horizon = now - tonumber(ARGV[2])
local scan = redis.call('SSCAN', KEYS[2], ARGV[3], 'COUNT', tonumber(ARGV[4]))
local dead = 0
for _, id in ipairs(scan[2]) do
  local done_at = tonumber(redis.call('HGET', KEYS[4] .. ':' .. id, 'done_at'))
  if done_at == nil or done_at <= horizon then
    redis.call('SREM', KEYS[2], id)
    redis.call('DEL', KEYS[4] .. ':' .. id)
    redis.call('HDEL', KEYS[3], id)
    dead = dead + 1
  end
end
return {#done, dead, scan[1]}
