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

-- Redis 8.2 gave XTRIM its ACKED option (trim only what every group acknowledged), in the
-- release that added XACKDEL: asked with COMMAND INFO on the node that runs the call, so a
-- cluster in the middle of an upgrade is right on each node, whatever the version says
-- (Valkey 8.1 reports 7.2.4 and has neither).
local function has_acked_trim()
  return redis.call('COMMAND', 'INFO', 'XACKDEL')[1] ~= false
end

-- Trim the entries below `id`, which every group acknowledged (see trim_acked).
local function trim_below(stream, id)
  if has_acked_trim() then
    redis.call('XTRIM', stream, 'MINID', id, 'ACKED')
  else
    redis.call('XTRIM', stream, 'MINID', id)
  end
end

-- Trimming follows the consumer groups: an entry goes only once every group acknowledged
-- it, i.e. below the smallest of each group's oldest pending id (delivered, not acked)
-- and last-delivered id (everything after it is unread). Redis before 8.2 (and Valkey)
-- has no ACKED trim, so it is computed here; the relay needs that id anyway (the length
-- cap counts what is unread), and where ACKED exists the trim carries it too, so Redis
-- itself refuses to delete what some group has not acknowledged. Exact (an entry inside a radix node is only flagged deleted, so
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
    trim_below(stream, safe)
  end
  return groups, acked
end
