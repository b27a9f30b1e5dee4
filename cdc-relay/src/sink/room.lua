-- (After trim.lua.)
--
-- Make room in a stream for entries a rebuild republishes: trim what every consumer group
-- acknowledged, then answer how many entries are left (all unread by some group) and how
-- many groups read the stream. The relay publishes only while that leaves room under its
-- --stream-max-len, so a rebuild never trims what nobody read; it waits for the groups.
--
-- KEYS[1]  the stream
-- Returns {entries, groups}.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0}
end
local groups = trim_acked(KEYS[1])
return {redis.call('XLEN', KEYS[1]), groups}
