-- Moves due intake entries into one apalis-redis 1.0.0 queue, but only while that queue's backlog
-- (active list + scheduled set) is under the high-water mark. apalis-redis promotes *all* due
-- scheduled ids with one `unpack`, which fails above ~8,000; keeping its backlog small keeps every
-- fetch far from that cliff. Writes the exact layout of apalis-redis's batch_push.lua (pinned).
--
-- Poison never reaches apalis: apalis decodes every fetched batch with serde_json, and a payload
-- that is not valid UTF-8 would fail the whole fetch and end the worker's stream, on every pod in
-- turn. Such an entry is moved straight to the dead set, with its reason in the task's meta hash
-- (`result`, `poison`) and its bytes, hex-encoded, as the task's data. Invalid JSON and unknown job
-- shapes are valid strings to apalis; the job service kills those with their decoding error.
--
-- KEYS[1] intake zset   KEYS[2] intake payload hash
-- KEYS[3] Q:active      KEYS[4] Q:scheduled  KEYS[5] Q:data  KEYS[6] Q:signal  KEYS[7] Q:meta
-- KEYS[8] Q:dead
-- ARGV[1] high-water mark; ARGV[2..] fresh task ids (ULIDs), one per entry that may move
-- Returns {moved, backlog after, intake entries left, poisoned}
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Whether s is valid UTF-8 (shortest forms, no surrogates, at most U+10FFFF).
local function valid_utf8(s)
  if not string.find(s, '[\128-\255]') then return true end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local len, lo, hi = 0, 128, 191
    if c < 128 then len = 1
    elseif c >= 194 and c <= 223 then len = 2
    elseif c == 224 then len = 3; lo = 160
    elseif (c >= 225 and c <= 236) or c == 238 or c == 239 then len = 3
    elseif c == 237 then len = 3; hi = 159
    elseif c == 240 then len = 4; lo = 144
    elseif c >= 241 and c <= 243 then len = 4
    elseif c == 244 then len = 4; hi = 143
    else return false end
    if len > 1 then
      if i + len - 1 > n then return false end
      local c2 = string.byte(s, i + 1)
      if c2 < lo or c2 > hi then return false end
      for k = i + 2, i + len - 1 do
        local ck = string.byte(s, k)
        if ck < 128 or ck > 191 then return false end
      end
    end
    i = i + len
  end
  return true
end

local backlog = redis.call('LLEN', KEYS[3]) + redis.call('ZCARD', KEYS[4])
local room = tonumber(ARGV[1]) - backlog
local n = math.min(room, #ARGV - 1)
local moved, poisoned = 0, 0
if n > 0 then
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, n)
  for i, entry in ipairs(due) do
    local payload = redis.call('HGET', KEYS[2], entry)
    redis.call('ZREM', KEYS[1], entry)
    redis.call('HDEL', KEYS[2], entry)
    if payload then
      local id = ARGV[i + 1]
      if valid_utf8(payload) then
        -- apalis decodes Q:data with its JSON codec into `String`: a JSON string never fails to
        -- decode, so a malformed payload reaches our handler (which records it as dead) instead
        -- of stopping the worker.
        redis.call('HSET', KEYS[5], id, cjson.encode(payload))
        redis.call('HSET', KEYS[7] .. ':' .. id, 'attempts', 0, 'max_attempts', 1,
          'status', 'Pending', 'idempotency_key', '', 'intake_entry', entry)
        redis.call('RPUSH', KEYS[3], id)
        moved = moved + 1
      else
        local reason = 'payload is not valid UTF-8 (' .. #payload .. ' bytes); never handed to a worker'
        local hex = string.gsub(string.sub(payload, 1, 512), '.', function(c)
          return string.format('%02x', string.byte(c))
        end)
        redis.call('HSET', KEYS[5], id, cjson.encode('hex:' .. hex))
        redis.call('HSET', KEYS[7] .. ':' .. id, 'attempts', 0, 'max_attempts', 1,
          'status', 'Killed', 'idempotency_key', '', 'intake_entry', entry,
          'result', cjson.encode({Err = reason}), 'poison', reason, 'done_at', tonumber(t[1]))
        redis.call('SADD', KEYS[8], id)
        poisoned = poisoned + 1
      end
    end
  end
  if moved > 0 then
    redis.call('DEL', KEYS[6])
    redis.call('LPUSH', KEYS[6], 1)
  end
end
return {moved, backlog + moved, redis.call('ZCARD', KEYS[1]), poisoned}
