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
-- Cost: the entries of one call are read, removed and pushed with one
-- command each (HMGET, ZREM, HDEL, HSET of the data hash, RPUSH); only the meta hash is one
-- HSET per entry. The task ids (ULIDs) are made here, from TIME and the caller's 12-character
-- random nonce, so the caller sends no ids. At the end the queue's entry in the due hint (KEYS[9])
-- is set to the earliest waiting entry left (or removed when none waits): the
-- feeder asks the hint, not every intake, on its ticks. Every intake writer lowers the hint
-- (`ZADD LT`), so it is never later than the earliest waiting entry.
--
-- KEYS[1] intake zset   KEYS[2] intake payload hash
-- KEYS[3] Q:active      KEYS[4] Q:scheduled  KEYS[5] Q:data  KEYS[6] Q:signal  KEYS[7] Q:meta
-- KEYS[8] Q:dead        KEYS[9] the due hint zset (member: intake key, score: earliest due ms)
-- ARGV[1] high-water mark; ARGV[2] most entries to move; ARGV[3] 12 Crockford base32 characters
-- (random, fresh per call) that, with the time and the entry's index, make each task id unique
-- Returns {moved, backlog after, entries waiting, poisoned, Redis now ms}
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local B32 = '0123456789ABCDEFGHJKMNPQRSTVWXYZ'
local function b32(n, width)
  local out = {}
  for i = width, 1, -1 do
    local d = n % 32
    out[i] = string.sub(B32, d + 1, d + 1)
    n = math.floor(n / 32)
  end
  return table.concat(out)
end
-- A ULID: 48 bits of ms (10 characters), then 80 bits: the call's nonce (60) and the index (20).
local time_part = b32(now_ms, 10) .. ARGV[3]
-- The index's 4 characters: one string.char of table lookups (cheaper than b32's table.concat).
local B32_BYTES = {string.byte(B32, 1, 32)}
local function task_id(i)
  return time_part .. string.char(B32_BYTES[math.floor(i / 32768) % 32 + 1],
    B32_BYTES[math.floor(i / 1024) % 32 + 1], B32_BYTES[math.floor(i / 32) % 32 + 1], B32_BYTES[i % 32 + 1])
end

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
local n = math.min(room, tonumber(ARGV[2]))
local moved, poisoned = 0, 0
local data, ids = {}, {}

-- One job into apalis, its payload already encoded as the JSON string apalis decodes.
local function push_encoded(i, entry, encoded)
  local id = task_id(i)
  data[#data + 1] = id
  data[#data + 1] = encoded
  redis.call('HSET', KEYS[7] .. ':' .. id, 'attempts', 0, 'max_attempts', 1,
    'status', 'Pending', 'idempotency_key', '', 'intake_entry', entry)
  ids[#ids + 1] = id
  moved = moved + 1
end

-- One job into apalis (or, poison, into the dead set) under the batch's index i.
local function push(i, entry, payload)
  if valid_utf8(payload) then
    -- apalis decodes Q:data with its JSON codec into `String`: a JSON string never fails to
    -- decode, so a malformed payload reaches our handler (which records it as dead) instead
    -- of stopping the worker.
    push_encoded(i, entry, cjson.encode(payload))
  else
    local id = task_id(i)
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

local index = 0
if n > 0 then
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, n)
  if #due > 0 then
    local payloads = redis.call('HMGET', KEYS[2], unpack(due))
    redis.call('ZREM', KEYS[1], unpack(due))
    redis.call('HDEL', KEYS[2], unpack(due))
    for i, entry in ipairs(due) do
      index = index + 1
      if payloads[i] then push(index, entry, payloads[i]) end
    end
  end
  n = n - #due
end
if moved > 0 then
  redis.call('HSET', KEYS[5], unpack(data))
  redis.call('RPUSH', KEYS[3], unpack(ids))
  redis.call('DEL', KEYS[6])
  redis.call('LPUSH', KEYS[6], 1)
end
-- The hint: exactly the earliest waiting entry left, or nothing when none waits.
local earliest = nil
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if first[2] then earliest = tonumber(first[2]) end
local waiting = redis.call('ZCARD', KEYS[1])
if earliest then
  redis.call('ZADD', KEYS[9], earliest, KEYS[1])
else
  redis.call('ZREM', KEYS[9], KEYS[1])
end
return {moved, backlog + moved, waiting, poisoned, now_ms}
