#!/usr/bin/env bash
# Builds the JMS consumer once and prints the path of its jar; run it with
#   java -jar "$(bash integration/jms-consumer/build.sh)" --queue Q ...
# The build, its cache and its environment are integration/jms-build.sh's.
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../jms-build.sh" jms-consumer consumer
