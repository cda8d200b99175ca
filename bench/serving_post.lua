-- wrk script of bench/serving.py: POST request bodies read from a file (one JSON body a line), in turn.
--
--   BENCH_BODIES=bodies.jsonl BENCH_TOKEN=... BENCH_INTERVAL_MS=20 BENCH_LIMIT=6000 \
--     wrk -t1 -c20 -d5s -s bench/serving_post.lua http://127.0.0.1:PORT/v1/predict
--
-- BENCH_INTERVAL_MS > 0: each connection waits a random time of that mean (exponential, so the
-- connections do not fire in step) between a response and its next request; Debian's wrk 4 has no -R,
-- so c connections with a mean wait of c * 1000 / R - latency hold about R requests/s (the bench
-- reports the rate wrk achieved). 0: no wait (throughput). BENCH_LIMIT > 0: a thread stops after that
-- many responses (a bound on the count; -d bounds the time). done() prints one line, "WRK_JSON {...}",
-- latencies in microseconds; responses other than 2xx/3xx are wrk's status errors.

-- BENCH_BINARY=1: BENCH_BODIES lists binary bodies instead, one "<json header length> <file>" a line
-- (Triton's binary tensor extension: the JSON header, then the tensors' bytes), each sent with its
-- Inference-Header-Content-Length.

local bodies, headers, count = {}, {}, 0
local interval = tonumber(os.getenv("BENCH_INTERVAL_MS") or "0") or 0
local limit = tonumber(os.getenv("BENCH_LIMIT") or "0") or 0
local binary = os.getenv("BENCH_BINARY") == "1"
local at, answered = 0, 0

function init(args)
  local token = "Bearer " .. (os.getenv("BENCH_TOKEN") or "")
  for line in io.lines(os.getenv("BENCH_BODIES")) do
    count = count + 1
    if binary then
      local length, path = line:match("^(%d+) (.+)$")
      local file = assert(io.open(path, "rb"))
      bodies[count] = file:read("*a")
      file:close()
      headers[count] = {["Content-Type"] = "application/octet-stream", ["Authorization"] = token,
                        ["Inference-Header-Content-Length"] = length}
    else
      bodies[count] = line
    end
  end
  math.randomseed(os.time())
  at = math.random(count) - 1
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = token
end

function request()
  at = at % count + 1
  return wrk.format(nil, nil, headers[at], bodies[at])
end

if interval > 0 then
  function delay()  -- ms, whole: rounded at random so that the mean stays the interval
    local wait = -math.log(1 - math.random()) * interval
    local whole = math.floor(wait)
    if math.random() < wait - whole then whole = whole + 1 end
    return whole
  end
end

if limit > 0 then
  function response(status, headers, body)
    answered = answered + 1
    if answered >= limit then wrk.thread:stop() end
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "connect_errors": %d, "read_errors": %d, ' ..
    '"write_errors": %d, "status_errors": %d, "timeouts": %d, "mean_us": %.1f, "p50_us": %d, "p90_us": %d, ' ..
    '"p99_us": %d, "p999_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
