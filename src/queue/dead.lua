-- Requeues or discards dead jobs of one apalis-redis 1.0.0 queue (the operator's dead-set actions).
-- Only ids still in the dead set are touched, so running it twice, or from two consoles, acts once.
--
-- A requeued job goes back through the intake, like every re-run: its payload (the JSON string the
-- feeder stored in Q:data) is written under its intake entry id, due now, unless an entry with that
-- id is already waiting (a newer job of the same card and task): that one is kept and the dead job
-- is left in the dead set, counted as `kept`.
--
-- KEYS[1] Q:dead  KEYS[2] Q:data  KEYS[3] Q:meta (prefix)  KEYS[4] intake zset  KEYS[5] intake payload
-- KEYS[6] the intakes' due hint (lowered to now for a requeued entry, so the feeder sees it)
-- ARGV[1] "requeue" | "discard"; ARGV[2..] job ids
-- Returns {acted on, not dead (any more), kept because an entry was waiting}
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local acted, missing, kept = 0, 0, 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('SISMEMBER', KEYS[1], id) == 0 then
    missing = missing + 1
  else
    local remove = true
    if ARGV[1] == 'requeue' then
      local data = redis.call('HGET', KEYS[2], id)
      local entry = redis.call('HGET', KEYS[3] .. ':' .. id, 'intake_entry')
      if not entry or entry == '' then entry = id end
      local ok, payload = pcall(cjson.decode, data or '')
      if not ok or type(payload) ~= 'string' then payload = data or '' end
      if redis.call('ZADD', KEYS[4], 'NX', now_ms, entry) == 1 then
        redis.call('HSET', KEYS[5], entry, payload)
        if redis.call('ZADD', KEYS[6], 'LT', 'CH', now_ms, KEYS[4]) == 1 then
          redis.call('PUBLISH', (string.gsub(KEYS[6], ':due$', ':wake')), now_ms)
        end
      else
        remove = false
        kept = kept + 1
      end
    end
    if remove then
      redis.call('SREM', KEYS[1], id)
      redis.call('DEL', KEYS[3] .. ':' .. id)
      redis.call('HDEL', KEYS[2], id)
      acted = acted + 1
    end
  end
end
return {acted, missing, kept}
