#!/usr/bin/env bash
# Builds the JMS producer once and prints the path of its jar; run it with
#   java -jar "$(bash integration/jms-producer/build.sh)" --queue Q ...
# The build, its cache and its environment are integration/jms-build.sh's.
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../jms-build.sh" jms-producer producer
