-- Shared by the relay's scripts (put in front of publish.lua and room.lua): comparing
-- stream ids, and trimming what every consumer group acknowledged.

-- Ids compare as (ms, seq) pairs of unbounded decimals: by length, then lexically.
local function split(id)
  local dash = string.find(id, '-', 1, true)
  return string.sub(id, 1, dash - 1), string.sub(id, dash + 1)
end
local function num_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function id_less(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  if am ~= bm then return num_less(am, bm) end
  return num_less(as, bs)
end

-- Trimming follows the consumer groups: an entry goes only once every group acknowledged
-- it, i.e. below the smallest of each group's oldest pending id (delivered, not acked)
-- and last-delivered id (everything after it is unread). Redis 7.0 has no ACKED trim, so
-- it is computed here. Exact (an entry inside a radix node is only flagged deleted, so
-- this costs little more than `~`). Nothing at or above `floor` (the record's
-- `watermark_from`, or false) goes either: a catch-up compares the outbox with the entries
-- from there on, and one trimmed away would be published again. Returns how many groups
-- read the stream (0: none, and nothing counts as read), and the id below which every group
-- acknowledged everything (nil with no group).
local function trim_acked(stream, floor)
  local safe, groups = nil, 0
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    groups = groups + 1
    local name, pending, last
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1]
      elseif g[i] == 'pending' then pending = g[i + 1]
      elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    local keep = last
    if pending > 0 then
      keep = redis.call('XPENDING', stream, name)[2]
    end
    if not safe or id_less(keep, safe) then safe = keep end
  end
  local acked = safe
  if safe and floor and id_less(floor, safe) then safe = floor end
  if safe and safe ~= '0-0' then
    redis.call('XTRIM', stream, 'MINID', safe)
  end
  return groups, acked
end
