-- Reconcile's filter (`polling::chain::maybe_dead`): which of a batch of cards `start_if_dead`
-- (jobs/src/chain.lua) may act on, read in one call so that the card refs travel once and only
-- the few that may need a start come back: a pass over cards whose chains are all live costs one
-- call per batch, not one script call per card.
--
-- KEYS[1] chain hash ({prefix}:chain:{task})  KEYS[2] chain due set ({prefix}:chain:{task}:due)
-- ARGV[1] grace ms  ARGV[2..] card refs
-- Returns the card refs whose chain is not live and indexed: no entry (or no chain id in it), no
-- score in the due set (an entry from before the index, which the chain script indexes), or a
-- due time (the score, less FED once fed) that is not after now - grace. This is the chain
-- script's own test (`due + grace > now`); only that script decides, atomically.
local FED = 1125899906842624 -- 2^50 ms, as in chain.lua
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = tonumber(ARGV[1])
local cards = {}
for i = 2, #ARGV do cards[#cards + 1] = ARGV[i] end
if #cards == 0 then return {} end
local entries = redis.call('HMGET', KEYS[1], unpack(cards))
local scores = redis.call('ZMSCORE', KEYS[2], unpack(cards))
local out = {}
for i, card in ipairs(cards) do
  local entry, score = entries[i], scores[i]
  local live = false
  if entry and string.match(entry, '[^|]+') and score then
    local s = tonumber(score)
    if s >= FED then s = s - FED end
    live = s + grace > now
  end
  if not live then out[#out + 1] = card end
end
return out
