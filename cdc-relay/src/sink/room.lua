-- (After trim.lua.)
--
-- Make room in a stream for entries a catch-up publishes from the outbox table: trim what
-- every consumer group acknowledged, then answer how many entries are left (all unread by
-- some group, but for the few a catch-up compares) and how many groups read the stream. A
-- catch-up publishes only while that leaves room under --stream-max-len: it goes at the
-- consumers' pace and never makes anything unread go.
--
-- KEYS[1]  the stream
-- Returns {entries, groups}. (Trimmed without the watermark's floor: the shard catching up
-- compares with the entries it copied when it began; what every group read may go.)

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0}
end
local groups = trim_acked(KEYS[1], false)
return {redis.call('XLEN', KEYS[1]), groups}
