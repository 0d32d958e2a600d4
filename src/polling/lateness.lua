-- How late one task's polling runs, fleet-wide, in one call: the polls that are due and have not
-- started, and the due time of the oldest of them. Read for the fleet-wide gauges
-- (`cardworker_poll_due_now`, `cardworker_poll_overdue_seconds`), never on a poll's path.
--
-- KEYS[1] the chain due set (card -> due ms while the poll waits to be fed, FED + due ms once fed)
-- KEYS[2] the late set (card -> the due ms of a poll that was deferred, written at its first
--         deferral: a deferral re-scores the due set to the deferred time, so the due set alone
--         would show a poll starved of tokens as due in the future)
-- KEYS[3] the chain hash (card -> `chain|unchanged|last|since|state[|run marker]`)
-- ARGV[1] FED (2^50)
-- ARGV[2] how many entries of the fed range and of the late set to look at, oldest first
-- Returns {now ms, oldest due ms or -1, due and not started}.
--
-- Counted: the waiting polls already due (one ZCOUNT of the due set's head range); the fed polls
-- (in apalis, or fetched and waiting for tokens) whose chain entry carries no run marker, among
-- the ARGV[2] oldest; the deferred polls waiting out their back-off, among the ARGV[2] oldest of
-- the late set, at the due time of their first deferral. A late entry whose chain no longer waits
-- on a deferral (it polled, was replaced or ended) is removed here: the late set holds at most one
-- entry per deferred chain, and each goes at the first read after its chain polls.

local FED = tonumber(ARGV[1])
local walk = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local oldest = nil
local function seen(due)
  if not oldest or due < oldest then oldest = due end
end

-- The fields of a chain entry: the fifth is the next job's state (`failures` or
-- `failures.deferrals`), the sixth the run marker of a poll that passed its check.
local function fields(entry)
  local out, from = {}, 1
  while true do
    local at = string.find(entry, '|', from, true)
    if not at then
      out[#out + 1] = string.sub(entry, from)
      return out
    end
    out[#out + 1] = string.sub(entry, from, at - 1)
    from = at + 1
  end
end

local function running(entry)
  local f = fields(entry)
  return f[6] ~= nil and f[6] ~= '', f
end

-- Waiting and due: the head of the due set up to now.
local count = redis.call('ZCOUNT', KEYS[1], '-inf', now)
if count > 0 then
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
  if head[2] then seen(tonumber(head[2])) end
end

-- Fed and not started: the oldest fed entries whose chain carries no run marker.
local fed = redis.call('ZRANGEBYSCORE', KEYS[1], FED, '+inf', 'WITHSCORES', 'LIMIT', 0, walk)
for i = 1, #fed, 2 do
  local due = tonumber(fed[i + 1]) - FED
  if due <= now then
    local entry = redis.call('HGET', KEYS[3], fed[i])
    if entry and not running(entry) then
      count = count + 1
      seen(due)
    end
  end
end

-- Deferred: the late set's oldest entries whose chain still waits on a deferral.
local late = redis.call('ZRANGE', KEYS[2], 0, walk - 1, 'WITHSCORES')
for i = 1, #late, 2 do
  local card, first_due = late[i], tonumber(late[i + 1])
  local entry = redis.call('HGET', KEYS[3], card)
  local deferred = false
  local is_running = false
  if entry then
    local f
    is_running, f = running(entry)
    local d = string.match(f[5] or '', '^%d+%.(%d+)$')
    deferred = d ~= nil and tonumber(d) > 0
  end
  if is_running then
    -- Its poll passed the budget and runs: started, though its entry still names the deferral.
  elseif not deferred then
    redis.call('ZREM', KEYS[2], card)
  else
    seen(first_due)
    local s = redis.call('ZSCORE', KEYS[1], card)
    s = s and tonumber(s)
    -- Counted above when its back-off is over (due, or fed); here while it waits it out.
    if s and s > now and s < FED then count = count + 1 end
  end
end

return {now, oldest or -1, count}
