-- The acknowledgement of finished jobs: apalis-redis 1.0.0's `handle_results.lua`,
-- except for a job that is done. apalis adds a done job to the queue's done set and rewrites its
-- meta hash (about 700 bytes kept until the trimmer deletes both); nothing reads either for a done
-- job, so here a done job's data and meta hash are deleted at once, and the done set is not
-- written. A failed or killed job is acknowledged exactly as apalis does (the scheduled set for a
-- retry, or the dead set), with its result in its meta hash, where `dead list` and the console
-- read it.
--
-- A job that is no longer in this worker's inflight set (a peer's orphan recovery took it back,
-- so it runs again elsewhere) is left alone, data and all, and answered 0; apalis fails the whole
-- acknowledgement on it, which stops the worker.
--
-- KEYS[1] this worker's inflight set  KEYS[2] Q:dead  KEYS[3] Q:scheduled  KEYS[4] Q:data
-- KEYS[5] Q:meta (the prefix of each job's meta hash, `Q:meta:<id>`, as apalis names them)
-- ARGV[1] 'batch', then groups of 4, one per job: task id, status (apalis's `Status` text),
-- result (JSON: {"Ok":...} or {"Err":"..."}), attempt
-- Returns one value per job: 1 acknowledged, 0 not this worker's any more.
local out = {}
local done, done_meta = {}, {}
local now
for i = 2, #ARGV - 3, 4 do
  local id, status, result, attempt = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('SREM', KEYS[1], id) == 0 then
    out[#out + 1] = 0
  elseif status == 'Done' then
    done[#done + 1] = id
    done_meta[#done_meta + 1] = KEYS[5] .. ':' .. id
    out[#out + 1] = 1
  else
    if not now then now = tonumber(redis.call('TIME')[1]) end
    local n = tonumber(attempt) or 0
    if (status == 'Failed' or status == 'Pending') and n < 25 then
      -- apalis's retry, kept as it is: the one path cardworker leaves to it (the budget layer's
      -- `keep_for_apalis`, when Redis refused the re-enqueue).
      redis.call('ZADD', KEYS[3], now + n, id)
    else
      redis.call('SADD', KEYS[2], id)
    end
    redis.call('HSET', KEYS[5] .. ':' .. id, 'result', result, 'status', status, 'attempts', attempt,
      'done_at', now)
    out[#out + 1] = 1
  end
end
if #done > 0 then
  redis.call('HDEL', KEYS[4], unpack(done))
  redis.call('DEL', unpack(done_meta))
end
return out
