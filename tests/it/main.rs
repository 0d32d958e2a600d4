mod gateway;
