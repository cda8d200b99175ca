-- Append one update to the log and commit its Kafka offsets, fenced, in one atomic step (the job's
-- slot). The update's gradient blobs were written before, into each group's slot; a refused push
-- leaves them to the pusher to delete (and to the groups' sweepers, should the pusher die first).
-- KEYS[1] generation, KEYS[2] assignment, KEYS[3] offsets, KEYS[4] update_log, KEYS[5] clocks,
-- KEYS[6] unapplied (updates not yet applied by every group)
-- ARGV[1] member id, ARGV[2] generation, ARGV[3] clock, ARGV[4] max pending log entries,
-- ARGV[5] number of offset ranges n, ARGV[6 .. 5+3n] partition, first, next (per range),
-- ARGV[6+3n ..] stream field, value pairs of the log entry (the header).
-- Returns the new log entry id, or an error reply starting with FENCED, OFFSET, CLOCK or BACKPRESSURE.
local member, gen, clock = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function refuse(message)
  return redis.error_reply(message)
end
local current = redis.call('GET', KEYS[1])
if current ~= gen then
  return refuse('FENCED generation ' .. gen .. ' of member ' .. member ..
    ' is stale: current generation is ' .. tostring(current or 'unset'))
end
local n = tonumber(ARGV[5])
local owner = member .. '|' .. gen
for i = 0, n - 1 do
  local p = ARGV[6 + 3 * i]
  local holder = redis.call('HGET', KEYS[2], p)
  if holder ~= owner then
    return refuse('FENCED partition ' .. p .. ' is assigned to ' .. tostring(holder or 'nobody') ..
      ', not ' .. owner)
  end
end
for i = 0, n - 1 do
  local p, first = ARGV[6 + 3 * i], ARGV[7 + 3 * i]
  local committed = redis.call('HGET', KEYS[3], p)
  if committed and committed ~= first then
    return refuse('OFFSET partition ' .. p .. ': range starts at ' .. first ..
      ' but the committed offset is ' .. committed .. (tonumber(first) < tonumber(committed)
      and ' (a duplicate)' or ' (a gap)'))
  end
end
local last = tonumber(redis.call('HGET', KEYS[5], member) or '0')
if clock <= last then
  return refuse('CLOCK member ' .. member .. ' pushed clock ' .. ARGV[3] ..
    ' but its last pushed clock is ' .. last .. ' (a duplicate or out-of-order push)')
end
if tonumber(redis.call('GET', KEYS[6]) or '0') >= tonumber(ARGV[4]) then
  return refuse('BACKPRESSURE update log holds ' .. ARGV[4] ..
    ' unapplied updates; parameter servers are behind')
end
local fields = {}
for i = 6 + 3 * n, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local id = redis.call('XADD', KEYS[4], '*', unpack(fields))
for i = 0, n - 1 do
  redis.call('HSET', KEYS[3], ARGV[6 + 3 * i], ARGV[8 + 3 * i])
end
redis.call('HSET', KEYS[5], member, ARGV[3])
redis.call('INCR', KEYS[6])
return id
