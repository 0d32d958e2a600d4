-- Moves due intake entries into one apalis-redis 1.0.0 queue, but only while that queue's backlog
-- (active list + scheduled set) is under the high-water mark. apalis-redis promotes *all* due
-- scheduled ids with one `unpack`, which fails above ~8,000; keeping its backlog small keeps every
-- fetch far from that cliff. Writes the exact layout of apalis-redis's batch_push.lua (pinned).
--
-- KEYS[1] intake zset   KEYS[2] intake payload hash
-- KEYS[3] Q:active      KEYS[4] Q:scheduled  KEYS[5] Q:data  KEYS[6] Q:signal  KEYS[7] Q:meta
-- ARGV[1] high-water mark; ARGV[2..] fresh task ids (ULIDs), one per entry that may move
-- Returns {moved, backlog after, intake entries left}
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local backlog = redis.call('LLEN', KEYS[3]) + redis.call('ZCARD', KEYS[4])
local room = tonumber(ARGV[1]) - backlog
local n = math.min(room, #ARGV - 1)
local moved = 0
if n > 0 then
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, n)
  for i, entry in ipairs(due) do
    local payload = redis.call('HGET', KEYS[2], entry)
    redis.call('ZREM', KEYS[1], entry)
    redis.call('HDEL', KEYS[2], entry)
    if payload then
      local id = ARGV[i + 1]
      -- apalis decodes Q:data with its JSON codec into `String`: a JSON string never fails to
      -- decode, so a malformed payload reaches our handler (which records it as dead) instead
      -- of stopping the worker.
      redis.call('HSET', KEYS[5], id, cjson.encode(payload))
      redis.call('HSET', KEYS[7] .. ':' .. id, 'attempts', 0, 'max_attempts', 1,
        'status', 'Pending', 'idempotency_key', '', 'intake_entry', entry)
      redis.call('RPUSH', KEYS[3], id)
      moved = moved + 1
    end
  end
  if moved > 0 then
    redis.call('DEL', KEYS[6])
    redis.call('LPUSH', KEYS[6], 1)
  end
end
return {moved, backlog + moved, redis.call('ZCARD', KEYS[1])}
