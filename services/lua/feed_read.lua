-- Read one shard group's feed (GroupKeys.feed) after a position, with the rows it names as they are
-- now, in the group's slot: what a serving system that keeps a copy of the tables applies to it.
--
-- The feed's entries (written by apply.lua and rows_sweep.lua, atomically with the rows they name)
-- say which rows changed; this script returns, for the union of the IDs named by the entries after
-- `since` (as many entries as `limit` and `most_rows` allow, at least one), each ID's current record
-- (its version and values: an upsert) or its absence (a tombstone). Reading the rows as they are now,
-- not values kept in the entries, is what makes a copy exact: once a reader has applied every entry
-- up to the head, its copy of the group's part of each table equals the rows hash at that read.
--
-- Called through services.scripts.FeedReadCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] version        the group's version
-- KEYS[2] feed           the group's changelog
-- KEYS[3] feed_head      its last position
-- KEYS[4..] tables       each table's rows hash, in the order of ARGV's tables
-- ARGV[1] since          the position the reader has applied (0: none)
-- ARGV[2] limit          most entries read
-- ARGV[3] most_rows      stop after the entry that brings the IDs named to this many
-- ARGV[4..] tables       per table: its name, then the bytes of each record returned (a prefix)
--
-- Returns {'OK', position reached, group version, 1 when an entry read changed dense shards (else 0),
-- the feed's head, {each entry's `ms`}, then per table (ARGV's order): the IDs with a row, their record
-- prefixes, the IDs without one (8-byte IDs and prefixes, concatenated)}; {'AHEAD', head} when `since`
-- is past the head; {'GONE', oldest, head} when the entries after `since` are no longer all there
-- (trimmed, or a checkpoint restored since): `oldest` is the smallest `since` this group answers now.
local K_VERSION = 1
local K_FEED = 2
local K_FEED_HEAD = 3
local K_TABLES = 4
local A_SINCE = 1
local A_LIMIT = 2
local A_MOST_ROWS = 3
local A_TABLES = 4

local since, limit, most = tonumber(ARGV[A_SINCE]), tonumber(ARGV[A_LIMIT]), tonumber(ARGV[A_MOST_ROWS])
local head = tonumber(redis.call('GET', KEYS[K_FEED_HEAD]) or '0')
if since > head then
  return {'AHEAD', head}
end

-- table name -> its index among the tables asked
local index, width = {}, {}
for j = 0, (#ARGV - A_TABLES + 1) / 2 - 1 do
  index[ARGV[A_TABLES + 2 * j]] = j + 1
  width[j + 1] = tonumber(ARGV[A_TABLES + 2 * j + 1])
end
local named, order = {}, {}  -- per table: set of IDs named, and the IDs in first-named order
for j = 1, #width do
  named[j], order[j] = {}, {}
end

local position, dense, ms, count = since, 0, {}, 0
local function take(e)  -- count entry e in: its time, dense flag and IDs
  local fields = e[2]
  for f = 1, #fields, 2 do
    local name, value = fields[f], fields[f + 1]
    if name == 'd' then
      if value == '1' then
        dense = 1
      end
    elseif name == 'ms' then
      ms[#ms + 1] = tonumber(value)
    elseif name ~= 'v' then
      local t = index[string.sub(name, 3)]
      if not t then
        return redis.error_reply('feed_read.lua: entry ' .. e[1] .. ' names table ' .. name .. ', not asked')
      end
      local set, list = named[t], order[t]
      for k = 1, #value, 8 do
        local id = string.sub(value, k, k + 7)
        if not set[id] then
          set[id] = true
          list[#list + 1] = id
          count = count + 1
        end
      end
    end
  end
end
local more = true
while more and position < head and #ms < limit and (#ms == 0 or count < most) do
  -- a few entries at a time: the IDs they carry are copied into Lua, so no more than are taken
  local step = redis.call('XRANGE', KEYS[K_FEED], (position + 1) .. '-0', '+', 'COUNT', math.min(16, limit - #ms))
  more = #step > 0
  for _, e in ipairs(step) do
    local at = tonumber(string.match(e[1], '^(%d+)-'))
    if at ~= position + 1 or (#ms > 0 and count >= most) or #ms >= limit then
      more = false  -- a gap (read as gone below, or at the next read), or enough taken
      break
    end
    local err = take(e)
    if err then
      return err
    end
    position = at
  end
end
if position == since and since < head then
  -- the entry after `since` is gone: the oldest `since` answered is the one before the oldest entry
  -- kept, or the head when none is kept (a checkpoint restored: its gap is the newest position)
  local first = redis.call('XRANGE', KEYS[K_FEED], (since + 1) .. '-0', '+', 'COUNT', 1)
  local oldest = head
  if #first > 0 then
    oldest = tonumber(string.match(first[1][1], '^(%d+)-')) - 1
  end
  return {'GONE', oldest, head}
end

local out = {'OK', position, tonumber(redis.call('GET', KEYS[K_VERSION]) or '0'), dense, head, ms}
for t = 1, #width do
  local list, size = order[t], width[t]
  local up, records, gone = {}, {}, {}
  for i = 1, #list, 4000 do
    local fields = {unpack(list, i, math.min(i + 3999, #list))}
    local got = redis.call('HMGET', KEYS[K_TABLES + t - 1], unpack(fields))
    for k = 1, #fields do
      if got[k] then
        up[#up + 1] = fields[k]
        records[#records + 1] = string.sub(got[k], 1, size)
      else
        gone[#gone + 1] = fields[k]
      end
    end
  end
  out[#out + 1] = table.concat(up)
  out[#out + 1] = table.concat(records)
  out[#out + 1] = table.concat(gone)
end
return out
