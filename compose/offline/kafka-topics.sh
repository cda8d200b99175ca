#!/bin/sh
# kafka-topics.sh of the Kafka distribution (the compose healthcheck runs it), on the jars in libs/
exec java -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
  -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp '/opt/kafka/libs/*' org.apache.kafka.tools.TopicCommand "$@"
